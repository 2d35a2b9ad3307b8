"""A load copy that does not stop after its timeout and abort (a hung device) may
still write the engine's slots: ``retrieve`` must not answer a miss (0), which
lets the engine recompute into or reuse those slots, but raise
``SlotsStillWrittenError`` (error type ``SlotsInUse`` on the engine API);
docs/agent.md "Call deadlines".

The stuck copy is a copy that waits for an event the test sets only at the end
(it ignores its abort, like a hung device): deterministic, no timing asserted.
The stores' own stop bounds are raised to 600 s: the answer must still come
within the call budget (the stop wait takes its share of it, not the store's
bound), or the engine would get the server's last-resort timeout first and take
the slots for free. Real embedded backends, real stage stores and real fan-out
sockets on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

import node_agent.backend.stage_store as stage_store
import node_agent.coordinator.leader as leader_mod
from node_agent.coordinator import SlotsStillWrittenError
from node_agent.coordinator.leader import LeaderRole
from node_agent.vocab.placement import Direction, TransferPlan
from tests.coordinator.harness import LAYOUT, kv_content, read_slots, wait_completed
from tests.coordinator.pairs import InProcessGroup
from tests.coordinator.test_leader_copy_end import Single

TPB = LAYOUT.tokens_per_block
TOKENS = np.arange(100, 100 + 2 * TPB)
TIMEOUTS = {"engine_call_seconds": 2.0, "fanout_wait_seconds": 0.6, "transfer_seconds": 0.3}
HUNG = 600.0
"""A stop bound no call may wait out (the test's futures give up after 60 s)."""


def hang_loads(store: Any) -> tuple[threading.Event, threading.Event]:
    """Make ``store``'s LOAD copies hang (ignoring their abort) until the returned
    ``release`` is set; ``started`` is set when one began. Stores copy normally."""
    started, release = threading.Event(), threading.Event()
    copy = store.copy

    def hung_copy(plan: TransferPlan, slots: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if plan.direction is Direction.LOAD:
            started.set()
            assert release.wait(60), "the test never released the hung copy"
        copy(plan, slots, *args, **kwargs)

    store.copy = hung_copy
    return started, release


@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> Iterator[Single]:
    monkeypatch.setattr(leader_mod, "STOP_WAIT_SECONDS", HUNG)
    s = Single(engine_call_seconds=1.0, fanout_wait_seconds=0.3, transfer_seconds=0.2)
    try:
        yield s
    finally:
        s.close()


def test_a_leader_load_that_does_not_stop_is_not_answered_as_a_miss(single: Single) -> None:
    assert single.store("src", TOKENS, np.arange(len(TOKENS))) >= 0
    wait_completed(single.conn, "src")
    assert single.conn.lookup("dst", TOKENS) == len(TOKENS)
    leader = single.leader
    started, release = hang_loads(leader.backend._store)  # type: ignore[attr-defined]
    try:
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(single.conn.retrieve, "dst", torch.arange(100, 100 + len(TOKENS)))
            with pytest.raises(SlotsStillWrittenError, match=r"retrieve 'dst'.*keep those "
                               r"slots out of use") as caught:
                call.result(60)  # within the call budget, not STOP_WAIT_SECONDS
        assert started.is_set()
        assert caught.value.wire_type == "SlotsInUse"
        assert leader.counters.loads_still_writing == 1
        assert leader.counters.retrieve_misses == 1
    finally:
        release.set()
    # Once the copy ended, the group serves the prefix again.
    assert single.conn.lookup("again", TOKENS) == len(TOKENS)


def test_a_follower_load_that_does_not_stop_is_not_answered_as_a_miss(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_store, "STOP_SECONDS", HUNG)
    with InProcessGroup(2, **TIMEOUTS) as g:
        g.store_everywhere("s", TOKENS)
        assert g.lookup_everywhere("q", TOKENS) == [len(TOKENS), len(TOKENS)]
        follower = g.follower(1)
        started, release = hang_loads(follower.store)
        try:
            dst = np.arange(300, 300 + len(TOKENS))
            follower_call = g.retrieve(1, "q", dst)
            leader_call = g.retrieve(0, "q", dst)
            with pytest.raises(SlotsStillWrittenError, match=r"PP stage 1 did not stop"):
                follower_call.result(60)  # within the call budget, not STOP_SECONDS
            assert started.is_set()
            # Every other stage answers a miss (the follower acked a failure), and
            # the leader's slots were not written.
            assert leader_call.result(30) == 0
            leader = g.conns[0]._role
            assert isinstance(leader, LeaderRole)
            assert not np.array_equal(read_slots(g.bufs[0], dst), kv_content(0, TOKENS))
            assert follower.counters.loads_still_writing == 1
        finally:
            release.set()

"""A follower applies a leader decision only to its own call for the same rid,
kind and tokens (docs/invariants.md, invariant 8), whatever the lag between
the stages, rid reuse, releases and rejected inputs. Two (or three) connectors
in one process, real fan-out sockets on loopback, each stage's engine calls on
its own thread; every load is checked byte for byte against the stage's own KV
of exactly the tokens looked up.

Each test is one call order that once went wrong
that wrote or loaded another request's KV, lost a store or answered
inconsistently before content-addressed pairing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.coordinator import Coordinator
from node_agent.coordinator.follower import FollowerRole
from tests.coordinator.harness import LAYOUT, wait_completed
from tests.coordinator.pairs import InProcessGroup
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block
A = np.arange(100, 100 + 2 * TPB)
B = np.arange(900, 900 + 2 * TPB)  # same length as A: only the content differs



def _slots(base: int) -> np.ndarray:
    return np.arange(base, base + 2 * TPB)


def test_lagging_follower_pairs_each_store_of_a_reused_rid_with_its_own_decision(
        pair: InProcessGroup) -> None:
    task_a = pair.store(0, "r", A, _slots(0)).result(30)
    pair.call(0, lambda c: c.release("r")).result(30)
    task_b = pair.store(0, "r", B, _slots(16)).result(30)
    assert task_a >= 0 and task_b >= 0 and task_a != task_b
    pair.caught_up(1)  # the follower holds A's decision, the RELEASE and B's decision
    assert pair.store(1, "r", A, _slots(100)).result(30) == task_a
    pair.call(1, lambda c: c.release("r")).result(30)
    assert pair.store(1, "r", B, _slots(116)).result(30) == task_b
    pair.settle()
    assert pair.conns[0].status()["counters"]["stores_published"] == 2
    assert pair.load_everywhere("qb", B) == [len(B), len(B)]
    assert pair.load_everywhere("qa", A, base_slot=300) == [len(A), len(A)]


def test_lagging_follower_lookup_of_a_reused_rid_never_takes_the_next_lookups_hit(
        pair: InProcessGroup) -> None:
    pair.store_everywhere("s", B)
    # The leader's engine runs ahead: a miss for A, release, a hit for B.
    assert pair.call(0, lambda c: c.lookup("r", A)).result(30) == 0
    assert pair.retrieve(0, "r", []).result(30) == 0
    pair.call(0, lambda c: c.release("r")).result(30)
    assert pair.call(0, lambda c: c.lookup("r", B)).result(30) == len(B)
    pair.caught_up(1)
    # The follower makes the same calls later: A is a miss there too.
    assert pair.call(1, lambda c: c.lookup("r", A)).result(30) == 0
    assert pair.retrieve(1, "r", []).result(30) == 0
    pair.call(1, lambda c: c.release("r")).result(30)
    assert pair.call(1, lambda c: c.lookup("r", B)).result(30) == len(B)
    dst = np.arange(200, 200 + len(B))
    loaded = [f.result(30) for f in [pair.retrieve(r, "r", dst) for r in (0, 1)]]
    assert loaded == [len(B), len(B)]
    assert all(pair.loaded_ok(r, B, dst, len(B)) for r in (0, 1))


BAD_FOLLOWER_INPUTS: list[tuple[str, Callable[[Coordinator], Any]]] = [
    ("kv_indices None", lambda c: c.store_kv("r", A, None)),  # type: ignore[arg-type]
    ("bf16 token tensor", lambda c: c.store_kv("r", torch.as_tensor(A, dtype=torch.bfloat16),
                                               torch.as_tensor(_slots(100)))),
    ("2-D kv_indices", lambda c: c.store_kv("r", A, np.stack([_slots(100), _slots(200)], 1))),
    ("bool among token ids", lambda c: c.store_kv("r", [True, *A.tolist()[1:]], _slots(100))),
]


@pytest.mark.parametrize("what, bad", BAD_FOLLOWER_INPUTS, ids=[b[0] for b in BAD_FOLLOWER_INPUTS])
def test_any_rejection_leaves_the_stream_as_if_the_call_was_not_made(
        pair: InProcessGroup, what: str, bad: Callable[[Coordinator], Any]) -> None:
    task_a = pair.store(0, "r", A, _slots(0)).result(30)
    with pytest.raises(ValueError):
        pair.call(1, bad).result(30)
    task_b = pair.store(0, "r", B, _slots(16)).result(30)
    assert task_a >= 0 and task_b >= 0
    # The follower's next store is for B: it takes B's decision, never A's.
    assert pair.store(1, "r", B, _slots(116)).result(30) == task_b
    pair.settle()
    assert pair.load_everywhere("qb", B) == [len(B), len(B)]
    # A was never stored on the follower: not visible on any stage.
    assert pair.load_everywhere("qa", A, base_slot=300) == [0, 0]
    counters = pair.conns[1].status()["counters"]
    assert counters["decisions_unpaired"] == 1 and counters["mismatches"] == 0


def test_follower_store_ended_by_the_leader_mid_copy_is_still_reported() -> None:
    g = InProcessGroup(2, engine_call_seconds=3.0, fanout_wait_seconds=1.2,
                       transfer_seconds=0.5)
    try:
        leader, follower = g.conns
        lrole = leader._role
        frole = follower._role
        assert lrole is not None and isinstance(frole, FollowerRole)

        def failing_launch(*args: object, **kw: object) -> list[int]:
            raise RuntimeError("injected launch failure")

        lrole.backend.launch = failing_launch  # type: ignore[method-assign,union-attr]
        real_execute = frole._execute
        ended = threading.Event()

        def execute_then_wait_for_the_verdict(key: Any, gen: int, d: Any,
                                              slots: Any) -> str | None:
            error = real_execute(key, gen, d, slots)
            # The copy is done; the leader's discard (RESULT) lands before this
            # stage records the store: the interleaving that lost the report.
            wait_for(lambda: key in frole._cancelled, "the leader's discard", 20)
            ended.set()
            return error

        frole._execute = execute_then_wait_for_the_verdict  # type: ignore[method-assign]
        assert g.store(0, "r", A, _slots(0)).result(30) == -1  # its launch failed
        task = g.store(1, "r", A, _slots(100)).result(30)
        assert ended.is_set() and task >= 0
        wait_completed(follower, "r", timeout=10)
        g.settle()
        assert leader.status()["counters"]["stores_discarded"] == 1
    finally:
        g.close()


def test_leader_release_overtaking_the_follower_store_loses_nothing(
        pair: InProcessGroup) -> None:
    task = pair.store(0, "r", A, _slots(0)).result(30)
    pair.call(0, lambda c: c.release("r")).result(30)
    pair.caught_up(1)
    assert pair.store(1, "r", A, _slots(100)).result(30) == task
    pair.call(1, lambda c: c.release("r")).result(30)
    pair.settle()
    assert pair.conns[0].status()["counters"]["stores_published"] == 1
    assert pair.load_everywhere("q", A) == [len(A), len(A)]
    assert pair.conns[1].status()["counters"]["decision_timeouts"] == 0


def test_release_ends_given_up_and_cancelled_marks_a_reused_rid_starts_clean(
        pair: InProcessGroup) -> None:
    pair.store_everywhere("s", B)
    # A follower lookup the leader never makes: it gives up (a mark), then release.
    assert pair.call(1, lambda c: c.lookup("r", A)).result(30) == 0
    for r in (0, 1):
        pair.call(r, lambda c: c.release("r")).result(30)
    # Two lookups of the reused rid: the second cancels the first's task.
    for _ in range(2):
        hits = [f.result(30) for f in [pair.call(r, lambda c: c.lookup("r", B))
                                       for r in (0, 1)]]
        assert hits == [len(B), len(B)]
    for r in (0, 1):
        pair.call(r, lambda c: c.release("r")).result(30)
    # The reused rid starts clean: its first lookup is again call one, cancelled
    # and given-up marks of earlier lives do not touch it.
    assert pair.load_everywhere("r", B) == [len(B), len(B)]


def test_retrieve_after_a_view_change_answers_a_miss(pair: InProcessGroup) -> None:
    pair.store_everywhere("s", B)
    hits = [f.result(30) for f in [pair.call(r, lambda c: c.lookup("r", B)) for r in (0, 1)]]
    assert hits == [len(B), len(B)]
    pair.publish(2)  # a new epoch between lookup and retrieve
    dst = np.arange(200, 200 + len(B))
    assert [f.result(30) for f in [pair.retrieve(r, "r", dst) for r in (0, 1)]] == [0, 0]


def test_reregistration_takes_the_new_buffers_size() -> None:
    g = InProcessGroup(1)
    try:
        conn = g.conns[0]
        small = (
            [torch.zeros(64, LAYOUT.num_kv_heads, LAYOUT.head_size)
             for _ in range(LAYOUT.num_layers)],
            [torch.zeros(64, LAYOUT.num_kv_heads, LAYOUT.head_size)
             for _ in range(LAYOUT.num_layers)],
        )
        conn.register_kv_buffers(0, small)
        with pytest.raises(ValueError, match="outside the registered buffers' 64 slots"):
            conn.store_kv("r", A, torch.arange(300, 300 + len(A)))
        conn.register_kv_buffers(0, g.bufs[0])  # the engine restarted with 512 slots
        assert g.store(0, "r", A, np.arange(300, 300 + len(A))).result(30) >= 0
        g.settle()
        assert g.load_everywhere("q", A) == [len(A)]
    finally:
        g.close()


def test_a_mismatched_call_never_applies_is_counted_and_resyncs(pair: InProcessGroup) -> None:
    other = A.copy()
    other[-1] += 1  # same rid, same length, one token differs on the follower
    task = pair.store(0, "r", A, _slots(0)).result(30)
    assert task >= 0
    assert pair.store(1, "r", other, _slots(100)).result(30) == -1
    assert pair.metric(1, "flexkv_agent_fanout_mismatch_total", group=pair.conns[1].cfg.group,
                       kind="put") == 1
    assert pair.conns[1].status()["counters"]["stores_executed"] == 0
    pair.wait_ready()  # resynced
    pair.settle()
    assert pair.load_everywhere("qa", A) == [0, 0]
    assert pair.load_everywhere("qo", other, base_slot=300) == [0, 0]


def test_a_rid_evicted_by_the_bound_keeps_its_lives_so_a_lagging_lookup_never_takes_the_next_lifes_hit() -> None:  # noqa: E501
    # Three pending decisions at most: the follower's book evicts the oldest rid.
    g = InProcessGroup(2, max_pending=3, fanout_wait_seconds=1.0)
    try:
        g.store_everywhere("s", B)
        others = [np.arange(5000 + 100 * i, 5000 + 100 * i + TPB) for i in range(3)]

        def leader_calls() -> list[Callable[[Coordinator], Any]]:
            return [lambda c: c.lookup("a", B), lambda c: c.release("a"),
                    *[lambda c, t=t, i=i: c.lookup(f"x{i}", t) for i, t in enumerate(others)],
                    lambda c: c.lookup("a", B)]

        # The leader's engine runs ahead: a lookup of B in the rid's first life
        # (never retrieved), release, lookups of other rids (their decisions push
        # the first life's out of the follower's book), then B again in the
        # rid's second life.
        got = [g.call(0, fn).result(30) for fn in leader_calls()]
        assert got[0] == got[-1] == len(B)
        g.caught_up(1)
        # The follower makes the same calls later. Its first call is of the
        # rid's first life, whose decision the bound dropped: a miss. The second
        # life's decision (same tokens) is never its own.
        assert g.call(1, lambda c: c.lookup("a", B)).result(30) == 0
        for fn in leader_calls()[1:-1]:
            g.call(1, fn).result(30)
        # Both stages' second-life lookups got the same hit: both load it.
        assert g.call(1, lambda c: c.lookup("a", B)).result(30) == len(B)
        dst = np.arange(200, 200 + len(B))
        loaded = [f.result(30) for f in [g.retrieve(r, "a", dst) for r in (0, 1)]]
        assert loaded == [len(B), len(B)]
        assert all(g.loaded_ok(r, B, dst, len(B)) for r in (0, 1))
    finally:
        g.close()


def test_a_group_flush_keeps_the_lives_of_a_rid_so_a_lagging_store_never_takes_the_next_lifes_decision(  # noqa: E501
        pair: InProcessGroup) -> None:
    # The leader's engine runs ahead: A in the rid's first life, release, a group
    # flush (RESET in the stream), A again in the rid's second life.
    task_a = pair.store(0, "r", A, _slots(0)).result(30)
    pair.call(0, lambda c: c.release("r")).result(30)
    pair.call(0, lambda c: c.reset()).result(30)
    task_a2 = pair.store(0, "r", A, _slots(16)).result(30)
    assert task_a >= 0 and task_a2 >= 0 and task_a != task_a2
    pair.caught_up(1)
    # The follower's first-life store: its decision died with the flush. The
    # second life's decision is never its own.
    assert pair.store(1, "r", A, _slots(100)).result(30) == -1
    pair.call(1, lambda c: c.release("r")).result(30)
    pair.call(1, lambda c: c.reset()).result(30)
    assert pair.store(1, "r", A, _slots(116)).result(30) == task_a2
    pair.settle()
    assert pair.conns[0].status()["counters"]["stores_published"] == 1
    assert pair.load_everywhere("q", A) == [len(A), len(A)]

"""A load is all or nothing across the stages of a group, also when the leader's
engine calls ``retrieve`` late (docs/pp.md, "Stores, loads and acks").

A follower loads its layers, acks, then waits a bounded time for the leader's
verdict; when none comes it answers 0 and its engine reuses the slots (SGLang
frees them, vLLM recomputes them). A leader whose ``retrieve`` comes after that
must answer 0 too: its engine would otherwise keep a prefix whose layers on the
follower's stage were never loaded. Two connectors in one process, real fan-out
sockets on loopback, each stage's engine calls on its own thread.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from node_agent.coordinator.leader import LeaderRole
from tests.coordinator.harness import LAYOUT
from tests.coordinator.pairs import InProcessGroup

TPB = LAYOUT.tokens_per_block
TOKENS = np.arange(100, 100 + 2 * TPB)
TIMEOUTS = {"engine_call_seconds": 2.0, "fanout_wait_seconds": 0.6, "transfer_seconds": 0.3}


def test_a_leader_retrieve_after_the_follower_gave_up_is_a_miss() -> None:
    with InProcessGroup(2, **TIMEOUTS) as g:
        g.store_everywhere("s", TOKENS)
        hits = [g.call(r, lambda c: c.lookup("q", TOKENS)).result(30) for r in (0, 1)]
        assert hits == [len(TOKENS), len(TOKENS)]
        dst = np.arange(300, 300 + len(TOKENS))
        # The follower's engine is first: it loads, acks, and gives up waiting.
        follower = g.retrieve(1, "q", dst).result(30)
        assert follower == 0
        leader = g.retrieve(0, "q", dst).result(30)
        assert leader == follower, (
            f"the leader answered {leader} after the follower answered {follower}")
        assert g.conns[0].status()["counters"]["late_verdict_misses"] == 1
        # The group still serves the prefix afterwards, on every stage.
        assert g.load_everywhere("again", TOKENS) == [len(TOKENS), len(TOKENS)]


def test_a_verdict_held_up_by_the_decision_lock_past_the_followers_wait_is_a_miss() -> None:
    """The leader's retrieve comes in time and its copy ends, but its verdict waits
    for the decision lock (a flush or another request's decision holds it) until
    the follower has given up: the leader answers 0 too."""
    with InProcessGroup(2, **TIMEOUTS) as g:
        g.store_everywhere("s", TOKENS)
        hits = [g.call(r, lambda c: c.lookup("q", TOKENS)).result(30) for r in (0, 1)]
        assert hits == [len(TOKENS), len(TOKENS)]
        leader = g.conns[0]._role
        assert isinstance(leader, LeaderRole)
        copied, locked = threading.Event(), threading.Event()
        real_end_copy = leader._end_copy

        def end_copy_then_hand_over(rid: str, tid: int, timeout: float) -> Any:
            status = real_end_copy(rid, tid, timeout)
            copied.set()
            assert locked.wait(30), "the test never took the decision lock"
            return status

        leader._end_copy = end_copy_then_hand_over  # type: ignore[method-assign]
        dst = np.arange(300, 300 + len(TOKENS))
        follower_call = g.retrieve(1, "q", dst)
        leader_call = g.retrieve(0, "q", dst)
        assert copied.wait(30), "the leader's load never ended its copy"
        with leader._decide:  # held, like a flush, until the follower gave up
            locked.set()
            follower = follower_call.result(30)
        assert follower == 0
        got = leader_call.result(30)
        assert got == follower, f"the leader answered {got} after the follower answered 0"
        assert leader.counters.late_verdict_misses == 1

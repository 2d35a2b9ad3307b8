"""The lives of a rid survive a resync (docs/invariants.md, invariant 8).

Every decision carries the leader's life of its rid, so a follower pairs a call
only with a decision of its own life even when the leader's RELEASE of the rid
was lost in a gap and the stage resynced: a lagging follower never takes a later
life's decision for the same tokens. Two connectors in one process, real fan-out
sockets on loopback; the gap is a real lost frame on the leader's sender.
"""

from __future__ import annotations

import numpy as np
import pytest

from node_agent.pp.messages import Op
from tests.coordinator.harness import LAYOUT
from tests.coordinator.pairs import InProcessGroup
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block
A = np.arange(100, 100 + 2 * TPB)


pytestmark = pytest.mark.pair_options(fanout_wait_seconds=1.0)


def _slots(base: int) -> np.ndarray:
    return np.arange(base, base + len(A))


def _lose_the_release(g: InProcessGroup, rid: str) -> None:
    """The leader releases ``rid``; the RELEASE never reaches stage 1, which sees
    the gap, resyncs (the leader flushes the dirty group) and is synced again."""
    flushes = g.conns[0].status()["counters"]["flushes"]
    lost = g.drop_to(1, {Op.RELEASE})
    g.call(0, lambda c: c.release(rid)).result(30)
    wait_for(lambda: lost.dropped >= 1, "the RELEASE dropped", 10)
    g.stop_dropping(1)
    wait_for(lambda: g.conns[0].status()["counters"]["flushes"] > flushes,
             "the leader flushed for the resync", 20)
    g.wait_ready(20)


def test_a_store_of_a_lagging_follower_never_takes_the_next_lifes_decision_after_a_lost_release(
        pair: InProcessGroup) -> None:
    # The leader's engine runs ahead: A in the rid's first life, release (lost
    # on its way to stage 1, which resyncs), A again in the rid's second life.
    assert pair.store(0, "r", A, _slots(0)).result(30) >= 0
    pair.caught_up(1)
    _lose_the_release(pair, "r")
    task2 = pair.store(0, "r", A, _slots(16)).result(30)
    assert task2 >= 0
    pair.caught_up(1)
    # The follower's first-life store: its decision died with the resync's flush.
    # The second life's decision is for the same tokens but never its own.
    assert pair.store(1, "r", A, _slots(100)).result(30) == -1
    assert pair.conns[1].status()["counters"]["stores_executed"] == 0
    pair.call(1, lambda c: c.release("r")).result(30)
    assert pair.store(1, "r", A, _slots(116)).result(30) == task2
    pair.settle()
    assert pair.conns[0].status()["counters"]["stores_published"] == 1
    assert pair.load_everywhere("q", A) == [len(A), len(A)]


def test_a_lookup_of_a_lagging_follower_never_takes_the_next_lifes_hit_after_a_lost_release(
        pair: InProcessGroup) -> None:
    pair.store_everywhere("s", A)
    # The leader's engine: a lookup of A in the rid's first life, never
    # retrieved; release (lost on its way to stage 1); A again in the second
    # life, a hit.
    assert pair.call(0, lambda c: c.lookup("r", A)).result(30) == len(A)
    pair.caught_up(1)
    _lose_the_release(pair, "r")
    # The resync flushed the group: store A again on both, under another rid.
    pair.store_everywhere("t", A, 32)
    assert pair.call(0, lambda c: c.lookup("r", A)).result(30) == len(A)
    pair.caught_up(1)
    # The follower's first-life lookup of the same tokens: its decision died
    # with the resync; the second life's hit is never its own.
    assert pair.call(1, lambda c: c.lookup("r", A)).result(30) == 0
    assert pair.retrieve(1, "r", []).result(30) == 0
    pair.call(1, lambda c: c.release("r")).result(30)
    assert pair.call(1, lambda c: c.lookup("r", A)).result(30) == len(A)
    dst = np.arange(200, 200 + len(A))
    loaded = [f.result(30) for f in [pair.retrieve(r, "r", dst) for r in (0, 1)]]
    assert loaded == [len(A), len(A)]
    assert all(pair.loaded_ok(r, A, dst, len(A)) for r in (0, 1))

"""Decisions name the cache epoch they were made under (docs/invariants.md, invariant 10).

The agents of a group apply a ``cacheEpoch`` bump at different moments (each
switches its key epoch, then resets). Meanwhile a stage on another epoch than
the decision's refuses it (a miss / -1, counted in
``flexkv_agent_cache_epoch_refused_total``), and the leader decides nothing
between its own key switch and its flush. Two connectors in one process, real
fan-out sockets on loopback; ``cache_epochs[r]`` stands for stage r's agent's
key epoch.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.coordinator.harness import LAYOUT
from tests.coordinator.pairs import InProcessGroup

TPB = LAYOUT.tokens_per_block
A = np.arange(100, 100 + 2 * TPB)
B = np.arange(900, 900 + 2 * TPB)
REFUSED = "flexkv_agent_cache_epoch_refused_total"


pytestmark = pytest.mark.pair_options(fanout_wait_seconds=1.0)


def _slots(base: int) -> np.ndarray:
    return np.arange(base, base + 2 * TPB)


def _store_everywhere(g: InProcessGroup, rid: str, tokens: np.ndarray) -> list[int]:
    return [f.result(30) for f in [g.store(r, rid, tokens, _slots(16 * r)) for r in (0, 1)]]


def _refused(g: InProcessGroup, rank: int, kind: str) -> float:
    return g.metric(rank, REFUSED, group=g.conns[rank].cfg.group, kind=kind)


def test_a_follower_on_another_cache_epoch_refuses_the_leaders_decisions(
        pair: InProcessGroup) -> None:
    assert len(set(_store_everywhere(pair, "s", A))) == 1
    pair.settle()
    # The follower's agent applied the bump first: the leader still decides
    # under epoch 0, whose blocks the follower must not load.
    pair.cache_epochs[1] = 1
    hits = [f.result(30) for f in [pair.call(r, lambda c: c.lookup("q", A)) for r in (0, 1)]]
    assert hits == [len(A), 0]
    dst = np.arange(200, 200 + len(A))
    loaded = [pair.retrieve(0, "q", dst).result(30), pair.retrieve(1, "q", []).result(30)]
    assert loaded == [0, 0]  # the leader's load needs every stage: a miss
    assert _refused(pair, 1, "get") == 1
    tasks = _store_everywhere(pair, "s2", B)
    assert tasks[0] >= 0 and tasks[1] == -1
    assert _refused(pair, 1, "put") == 1
    pair.settle()
    assert pair.conns[0].status()["counters"]["stores_discarded"] == 1
    assert pair.conns[1].status()["counters"]["stores_executed"] == 1  # "s" only
    # The leader's agent applies the bump too (key switch, then flush): the
    # group serves again, under epoch 1 only.
    pair.cache_epochs[0] = 1
    pair.call(0, lambda c: c.reset()).result(30)
    pair.caught_up(1)
    assert pair.load_everywhere("qa", A) == [0, 0]
    assert len(set(_store_everywhere(pair, "s3", A))) == 1
    pair.settle()
    assert pair.load_everywhere("qa2", A, base_slot=300) == [len(A), len(A)]


def test_between_its_key_switch_and_its_flush_the_leader_decides_nothing(
        pair: InProcessGroup) -> None:
    assert len(set(_store_everywhere(pair, "s", A))) == 1
    pair.settle()
    # The leader's agent switched its key epoch; its flush has not run yet. The
    # cache still holds epoch-0 blocks: no lookup may continue them.
    pair.cache_epochs[0] = 1
    hits = [f.result(30) for f in [pair.call(r, lambda c: c.lookup("q", A)) for r in (0, 1)]]
    assert hits == [0, 0]
    assert [pair.retrieve(r, "q", []).result(30) for r in (0, 1)] == [0, 0]
    assert _store_everywhere(pair, "s2", B) == [-1, -1]
    assert _refused(pair, 0, "get") == 1 and _refused(pair, 0, "put") == 1
    assert pair.conns[0].status()["counters"]["cache_epoch_refusals"] == 2
    # The flush, then the follower's own bump: the group serves epoch 1.
    pair.call(0, lambda c: c.reset()).result(30)
    pair.cache_epochs[1] = 1
    assert len(set(_store_everywhere(pair, "s3", B))) == 1
    pair.settle()
    assert pair.load_everywhere("qb", B) == [len(B), len(B)]
    assert pair.load_everywhere("qa", A, base_slot=300) == [0, 0]


def test_a_lookup_open_across_the_flush_of_a_bump_retrieves_as_a_miss_on_every_stage(
        pair: InProcessGroup) -> None:
    assert len(set(_store_everywhere(pair, "s", A))) == 1
    pair.settle()
    hits = [f.result(30) for f in [pair.call(r, lambda c: c.lookup("q", A)) for r in (0, 1)]]
    assert hits == [len(A), len(A)]
    # Both agents apply a bump between the engine's lookup and its retrieve.
    pair.cache_epochs[0] = pair.cache_epochs[1] = 1
    for r in (0, 1):
        pair.call(r, lambda c: c.reset()).result(30)
    pair.caught_up(1)
    dst = np.arange(200, 200 + len(A))
    assert [f.result(30) for f in [pair.retrieve(r, "q", dst) for r in (0, 1)]] == [0, 0]
    assert not any(pair.loaded_ok(r, A, dst, len(A)) for r in (0, 1))

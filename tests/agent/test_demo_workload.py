"""The demo's workload and its engine-side verification (no agent needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from node_agent.client import EngineClient, RankInfo
from node_agent.demo.engine import DemoEngine, percentiles, routed
from node_agent.demo.workload import DemoRequest, WorkloadSpec, generate
from node_agent.vocab.layout import KVDtype, KVLayout


def test_turns_repeat_the_previous_turn_as_prefix() -> None:
    spec = WorkloadSpec(conversations=3, turns=3, shared_prefixes=2, system_tokens=32,
                        user_tokens=8, reply_tokens=4)
    reqs = list(generate(spec))
    assert len(reqs) == spec.requests == 9
    by = {(r.conversation, r.turn): r for r in reqs}
    for c in range(3):
        for t in range(1, 3):
            prev = by[c, t - 1].full
            assert np.array_equal(by[c, t].prompt[:len(prev)], prev)
    # Conversations 0 and 2 share a system prompt; 0 and 1 do not.
    assert np.array_equal(by[0, 0].prompt[:32], by[2, 0].prompt[:32])
    assert not np.array_equal(by[0, 0].prompt[:32], by[1, 0].prompt[:32])
    assert list(generate(spec))[4].rid == reqs[4].rid  # deterministic for every stage


def test_verification_counts_corrupted_tokens(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype=KVDtype.FLOAT16,
                      tokens_per_block=4)
    engine = DemoEngine(EngineClient(tmp_path / "unused.sock", RankInfo("r")), layout, 64)
    try:
        tokens = np.arange(500, 532, dtype=np.int64)
        slots = np.arange(10, 42, dtype=np.int64)
        engine._write(tokens, 0, slots)
        assert engine._mismatches(tokens, slots) == 0
        engine.planes[3][20, 1, 5] += 1  # one element of token 10 in one plane
        engine.planes[0][41] = 0         # every element of token 31
        assert engine._mismatches(tokens, slots) == 2
    finally:
        engine.close()


def test_percentiles_of_latency_samples() -> None:
    p = percentiles([0.001] * 98 + [0.5, 0.5])
    assert p["count"] == 100 and abs(p["p50_ms"] - 1.0) < 1e-9 and p["p99_ms"] > 400
    assert percentiles([]) == {"p50_ms": 0.0, "p99_ms": 0.0, "count": 0}


def test_replicas_split_the_workload_so_each_next_turn_lands_on_another_replica() -> None:
    spec = WorkloadSpec(conversations=5, turns=3, shared_prefixes=2, system_tokens=32,
                        user_tokens=8, reply_tokens=4)
    shares = [list(routed(spec, i, 4)) for i in range(4)]
    rids = sorted(r.rid for share in shares for r in share)
    assert rids == sorted(r.rid for r in generate(spec))  # each request served once
    owner = {r.rid: i for i, share in enumerate(shares) for r in share}
    for c in range(5):
        for t in range(1, 3):
            assert owner[f"c{c}-t{t}"] != owner[f"c{c}-t{t - 1}"]
    assert [r.rid for r in routed(spec, 0, 1)] == [r.rid for r in generate(spec)]


class SharedIndexAgent:
    """Stands in for an agent whose replicas share one index: a lookup hits the
    longest whole-block prefix any engine stored; loads are refused (the engine
    then computes the prompt itself)."""

    def __init__(self, tokens_per_block: int) -> None:
        self.tpb = tokens_per_block
        self.stored: list[np.ndarray] = []

    def lookup(self, rid: str, tokens: np.ndarray) -> int:
        best = 0
        for s in self.stored:
            n = min(len(s), len(tokens))
            diff = np.flatnonzero(s[:n] != tokens[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        return best - best % self.tpb

    def retrieve(self, rid: str, slots: np.ndarray) -> int:
        return 0

    def store_kv(self, rid: str, tokens: np.ndarray, slots: np.ndarray) -> int:
        self.stored.append(np.asarray(tokens))
        return -1  # nothing to wait for

    def poll_completed(self) -> list[str]:
        return []

    def release(self, rid: str) -> None:
        return None

    def close(self) -> None:
        return None


def test_cross_replica_hits_count_only_hit_tokens_beyond_the_replicas_own_stores() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype=KVDtype.FLOAT16,
                      tokens_per_block=4)
    agent = SharedIndexAgent(layout.tokens_per_block)
    a, b = (DemoEngine(agent, layout, 256) for _ in range(2))  # type: ignore[arg-type]
    try:
        base = np.arange(100, 120, dtype=np.int64)  # 20 tokens
        first = DemoRequest("r1", 0, 0, base[:10], base[10:12])
        a.serve(first)  # a stores 12 tokens
        assert a.counts["hit_tokens"] == 0 and a.counts["cross_hit_tokens"] == 0
        second = DemoRequest("r2", 0, 1, base[:14], base[14:18])
        b.serve(second)  # hits 12 tokens (3 blocks) a stored
        assert (b.counts["hit_tokens"], b.counts["cross_hit_tokens"],
                b.counts["cross_hit_requests"]) == (12, 12, 1)
        third = DemoRequest("r3", 0, 2, base[:20], np.arange(4, dtype=np.int64))
        b.serve(third)  # hits 16 tokens b stored itself: no cross-replica hit
        assert (b.counts["hit_tokens"], b.counts["cross_hit_tokens"]) == (28, 12)
        a.serve(third)  # a stored 12 of those 20 tokens; b stored the other 8
        assert a.counts["hit_tokens"] == 20 and a.counts["cross_hit_tokens"] == 8
    finally:
        a.close()
        b.close()

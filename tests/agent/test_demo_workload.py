"""The demo's workload and its engine-side verification (no agent needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from node_agent.client import EngineClient, RankInfo
from node_agent.demo.engine import DemoEngine, percentiles
from node_agent.demo.workload import WorkloadSpec, generate
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

"""stats() and the Prometheus metrics the backend records into an injected AgentMetrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from node_agent.backend.embedded import EmbeddedBackend
from node_agent.metrics import AgentMetrics
from tests.backend.backend_helpers import (
    TPB,
    config,
    load,
    make_buffers,
    small_layout,
    store,
    tokens,
)


def _value(m: AgentMetrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


def test_stats_and_metrics_follow_a_store_spill_and_load(tmp_path: Path) -> None:
    layout = small_layout()
    metrics = AgentMetrics()
    cfg = config(layout, cpu_blocks=2, ssd_blocks=4, ssd_dir=tmp_path,
                 high_watermark=1.0, low_watermark=1.0)
    b = EmbeddedBackend(cfg, metrics=metrics)
    b.start()
    b.register_kv_buffers(0, make_buffers(layout, 64, 0))
    bpb = layout.bytes_per_block
    try:
        assert _value(metrics, "flexkv_agent_tier_capacity_bytes", tier="cpu") == 2 * bpb
        assert _value(metrics, "flexkv_agent_tier_capacity_bytes", tier="ssd") == 4 * bpb
        a, c = tokens(2 * TPB, seed=1), tokens(2 * TPB, seed=2)
        store(b, a, np.arange(2 * TPB, dtype=np.int64))
        store(b, c, np.arange(2 * TPB, 4 * TPB, dtype=np.int64))  # spills `a`
        load(b, a, np.arange(32, 32 + 2 * TPB, dtype=np.int64))
        load(b, c, np.arange(40, 40 + 2 * TPB, dtype=np.int64))
        s = b.stats()
        assert s.tiers["cpu"].used_bytes == 2 * bpb and s.tiers["ssd"].used_blocks == 2
        assert s.tiers["cpu"].evictions == 2 and s.tiers["ssd"].hit_blocks == 2
        assert s.tiers["cpu"].hit_blocks == 2
        assert s.registered_ranks == (0,) and s.expected_ranks == 1
        assert sum(s.tasks.values()) == 0
        assert _value(metrics, "flexkv_agent_stored_tokens_total") == 4 * TPB
        assert _value(metrics, "flexkv_agent_lookup_tokens_total") == 4 * TPB
        assert _value(metrics, "flexkv_agent_hit_tokens_total", tier="ssd") == 2 * TPB
        assert _value(metrics, "flexkv_agent_hit_tokens_total", tier="cpu") == 2 * TPB
        assert _value(metrics, "flexkv_agent_evictions_total", tier="cpu") == 2
        assert _value(metrics, "flexkv_agent_tier_used_bytes", tier="ssd") == 2 * bpb
        assert _value(metrics, "flexkv_agent_transfer_bytes_total",
                      direction="store", tier="cpu") == 4 * bpb
        assert _value(metrics, "flexkv_agent_transfer_bytes_total",
                      direction="load", tier="ssd") == 2 * bpb
        assert _value(metrics, "flexkv_agent_transfer_seconds_count", direction="load") == 2
        assert _value(metrics, "flexkv_agent_match_seconds_count", op="put") == 2
    finally:
        b.shutdown()


def test_task_counts_by_state() -> None:
    layout = small_layout()
    b = EmbeddedBackend(config(layout, cpu_blocks=8))
    b.start()
    b.register_kv_buffers(0, make_buffers(layout, 64, 0))
    try:
        t1, _ = b.put_match(tokens(TPB, seed=1))
        t2, _ = b.put_match(tokens(TPB, seed=2))
        [w] = b.launch([t2], [np.arange(TPB, dtype=np.int64)])
        b.wait([w], timeout=5, completely=True)
        b.put_match(tokens(TPB, seed=3))
        assert b.stats().tasks["matched"] == 2
        b.cancel([t1])
        assert b.stats().tasks["matched"] == 1
    finally:
        b.shutdown()

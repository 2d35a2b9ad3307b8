"""Smoke test of bench/replicas.py: with one and two engines on one agent it runs
(closed-loop and paced phases), verifies every loaded token and prints one
well-formed JSON object per result (no timing asserted: figures are
machine-dependent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_reports_load_lookups_paced_lookups_and_cross_hits_per_engine_count() -> None:
    out = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "replicas.py"), "--quick"],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    load = {r["engines"]: r for r in rows if r["bench"] == "replicas_load"}
    assert sorted(load) == [1, 2]
    # Every engine loaded its own two 64-token prompts in each of 3 rounds.
    for n, r in load.items():
        assert r["bytes"] == n * 2 * 3 * 64 * r["bytes_per_token"], r
        assert r["gbps"] > 0 and r["baseline_gbps"] == load[1]["gbps"]
    assert load[1]["ratio"] == 1.0
    # The engine-copied loads: no claim of the run ends early (each is committed,
    # none released unused), so the claim fence shows every one of them held.
    engine = {r["engines"]: r for r in rows if r["bench"] == "replicas_load_engine_copy"}
    assert sorted(engine) == [1, 2]
    assert all(r["held_by_fence"] == 1.0 and r["gbps"] > 0 for r in engine.values())
    lookup = {(r["engines"], r["percentile"]): r for r in rows if r["bench"] == "replicas_lookup"}
    assert sorted(lookup) == [(1, "p50"), (1, "p99"), (2, "p50"), (2, "p99")]
    assert lookup[2, "p99"]["goal_ratio_max"] == 2.0
    assert lookup[2, "p99"]["samples"] == 2 * lookup[1, "p99"]["samples"] == 12
    only = {(r["engines"], r["percentile"]): r for r in rows
            if r["bench"] == "replicas_lookup_only"}
    assert sorted(only) == sorted(lookup)
    assert only[2, "p99"]["samples"] == 12 and only[2, "p99"]["ms"] > 0
    assert all(r["aggregate_lookups_per_s"] > 0 for r in only.values())
    paced = {(r["engines"], r["percentile"]): r for r in rows
             if r["bench"] == "replicas_lookup_paced"}
    assert sorted(paced) == sorted(lookup)
    # Each engine issued 6 lookups (--quick) at the default pace of 50 per second.
    assert paced[2, "p99"]["samples"] == 2 * paced[1, "p99"]["samples"] == 12
    assert paced[2, "p99"]["goal_ratio_max"] == 2.0 and paced[2, "p99"]["ms"] > 0
    for (n, _), r in paced.items():
        assert r["lookup_rate_per_engine"] == 50.0 and r["requests_per_engine"] == 6
        assert r["offered_lookups_per_s"] == n * 50.0
        assert r["closed_loop_capacity_per_s"] == only[n, "p50"]["aggregate_lookups_per_s"]
        assert r["offered_to_capacity"] == round(n * 50.0 / r["closed_loop_capacity_per_s"], 3)
        assert r["answered_lookups_per_s"] > 0
    [cross] = [r for r in rows if r["bench"] == "replicas_cross_hits"]
    # Each of the 2 engines looked up the other's 2 prompts of 64 tokens.
    assert cross["engines"] == 2 and cross["other_prompt_tokens"] == 2 * 2 * 64
    assert 0 <= cross["hit_tokens"] <= cross["other_prompt_tokens"]
    assert cross["hit_rate"] == round(cross["hit_tokens"] / cross["other_prompt_tokens"], 4)

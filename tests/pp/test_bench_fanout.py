"""Smoke test of bench/fanout.py: it runs and prints well-formed results (no timing
assertions: figures are machine-dependent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_prints_one_json_object_per_result() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fanout.py"), "--quick", "--samples", "5",
         "--stream", "40"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert all(r["bench"] == "fanout" for r in rows)
    by_metric: dict[str, list[dict[str, object]]] = {}
    for r in rows:
        by_metric.setdefault(str(r["metric"]), []).append(r)
    lat = by_metric["latency"]
    assert {(r["impl"], r["followers"]) for r in lat} == {
        (impl, n) for impl in ("zmq-curve", "gloo-pickle") for n in (1, 3)}
    for r in lat:
        assert {"p50_us", "p99_us", "samples"} <= r.keys() and r["samples"] == 5
    assert {r["followers"] for r in by_metric["latency_ratio"]} == {1, 3}
    assert all(isinstance(r["met"], bool) for r in by_metric["latency_ratio"])
    assert {r["impl"] for r in by_metric["throughput"]} == {"zmq-curve", "gloo-pickle"}
    assert len(by_metric["throughput_ratio"]) == 1
    assert {r["impl"] for r in by_metric["payload_bytes"]} == {"zmq-curve", "gloo-pickle"}

"""The backend benchmarks run with tiny sizes and print one well-formed JSON object per row.

Speed is not asserted here (no timed assertions); only the output shape is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, tmp: Path) -> list[dict[str, object]]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # The bound is for a hung bench, not its speed: a loaded machine can take minutes.
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"bench/{script} exited {done.returncode}:\n{done.stderr}"
    out = done.stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert rows and all(isinstance(r, dict) for r in rows)
    return rows


def test_transfer_bench_rows(tmp_path: Path) -> None:
    rows = _run("transfer.py", "--tokens", "64", "--ssd-tokens", "32", "--layers", "2",
                "--heads", "2", "--head-size", "16", "--repeat", "1", "--cpu-rounds", "3",
                "--ssd-dir", str(tmp_path), tmp=tmp_path)
    assert [(r["row"], r.get("slots")) for r in rows] == [
        ("cpu_store", "pages"), ("cpu_load", "pages"), ("cpu_store", "tokens"),
        ("cpu_load", "tokens"), ("cpu_store", "sparse"), ("cpu_load", "sparse"),
        ("ssd_spill", "pages"), ("ssd_load", "pages")]
    for r in rows:
        assert r["bench"] == "transfer"
        assert {"gb_per_s", "baseline_gb_per_s", "ratio", "bytes"} <= set(r)
        assert float(r["ratio"]) > 0  # type: ignore[arg-type]
    assert rows[0]["goal_ratio"] == 0.9 and isinstance(rows[0]["goal_met"], bool)
    assert rows[2]["goal_ratio"] == 0.8 and rows[4]["goal_ratio"] == 0.8
    for r in rows[:6]:  # interleaved rounds: one ratio per round, the median reported
        ratios = r["round_ratios"]
        assert isinstance(ratios, list) and len(ratios) == 3
        assert r["ratio"] == ratios[1] and len(r["loadavg"]) == 3  # type: ignore[arg-type]
        # Process CPU seconds per round, baseline over ours (None when a clock read 0).
        assert r["cpu_ratio"] is None or float(r["cpu_ratio"]) > 0  # type: ignore[arg-type]


def test_match_bench_rows(tmp_path: Path) -> None:
    rows = _run("match.py", "--blocks", "400", "--prompt-tokens", "256", "--iters", "5",
                "--memory-sample-blocks", "100", tmp=tmp_path)
    assert [r["row"] for r in rows] == ["get_match_hit", "put_match_cached", "put_match_new",
                                        "memory"]
    for r in rows[:3]:
        assert {"p50_ms", "p99_ms", "baseline_p99_ms", "ratio_p99", "goal_met",
                "cpu_p99_ms"} <= set(r)
        assert r["index_blocks"] == 400
    assert float(rows[3]["tracemalloc_bytes_per_block"]) > 0  # type: ignore[arg-type]


def test_restart_bench_rows(tmp_path: Path) -> None:
    rows = _run("restart.py", "--gb", "0.01", "--layers", "2", "--prompt-blocks", "4",
                "--dir", str(tmp_path / "ssd"), tmp=tmp_path)
    assert [(r["row"], r.get("stop")) for r in rows] == [
        ("fill", None), ("restart", "clean"), ("hit_rate", "clean"), ("hit_rate", "no_spill"),
        ("load", None)]
    assert float(rows[0]["ratio"]) > 0  # type: ignore[arg-type]
    restart = rows[1]
    assert {"ready_seconds", "first_hit_seconds", "scan_gb_per_s", "ready_goal_met",
            "scan_goal_met"} <= set(restart)
    assert int(restart["recovered_blocks"]) > 0  # type: ignore[call-overload]
    assert rows[2]["before"] == 1.0 and 0 < float(rows[2]["after"]) <= 1  # type: ignore[arg-type]


def test_lookup_http_bench_rows(tmp_path: Path) -> None:
    rows = _run("lookup_http.py", "--quick", tmp=tmp_path)
    assert [(r["body"], r.get("where")) for r in rows] == [
        ("json", None), ("int64", None), ("int64", "in_process")]
    for r in rows[:2]:
        assert r["bench"] == "lookup_http" and r["cached_tokens"] == r["tokens"]
        assert {"lookup_p50_ms", "lookup_p99_ms", "healthz_p50_ms", "healthz_p99_ms",
                "ratio_p50", "ratio_p99"} <= set(r)
    assert {"lookup_p99_ms", "hash_p99_ms", "ratio_p99"} <= set(rows[2])

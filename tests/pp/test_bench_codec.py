"""Smoke test of bench/codec.py: it runs and prints one well-formed row per case,
with both codecs decoding to the same message (the bench asserts that before
timing). No timing assertions: figures are machine-dependent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_one_row_per_case_with_a_ratio() -> None:
    out = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bench" / "codec.py"), "--quick"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert all(r["bench"] == "codec" for r in rows)
    cases = [r for r in rows if "case" in r]
    assert [r["case"] for r in cases] == [
        "put decision, 2K blocks", "cancel", "release", "result",
        "engine lookup request header + 2048 tokens",
        "engine lookup request decode, typed msgspec.json"]
    for r in cases:
        assert r["baseline_us"] > 0 and r["msgspec_us"] > 0
        assert abs(r["ratio"] - r["msgspec_us"] / r["baseline_us"]) < 0.02
        assert r["wire_bytes"]["baseline"] > 0 and r["wire_bytes"]["msgspec"] > 0
    assert len(rows[-1]["loadavg"].split()) == 3

"""``bench/store_stages.py`` runs a real agent through its stage wrapper and
reports every stage of a store in order (shape only, no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_store_stages_reports_every_stage_in_order(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "store_stages.py"), "--rounds", "3",
         "--tokens", "64", "--layers", "1", "--evict"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
        text=True, timeout=120, check=True,
    ).stdout
    [row] = [json.loads(line) for line in out.splitlines() if line.strip()]
    stages = row["ms_since_store_kv_sent"]
    order = ["service.store_kv>", "put_match>", "put_match<", "launch>", "launch<",
             "copy>", "copy<", "finish_put>", "finish_put<", "total"]
    assert list(stages) == [k for k in [*order[:-1], "wait_completed.got", "total"]
                            if k in stages]
    assert set(order) <= set(stages)
    # Causal order of the medians: the copy ends before the put is finished, etc.
    assert stages["put_match>"] <= stages["put_match<"] <= stages["copy>"] <= stages["copy<"]
    assert stages["copy<"] <= stages["finish_put<"] <= stages["total"]

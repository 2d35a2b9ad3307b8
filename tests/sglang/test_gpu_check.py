"""scripts/gpu_check.sh on a host without a GPU: a clean SKIP, exit 0, nothing built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: run the check itself")
def test_gpu_check_skips_cleanly_without_a_gpu() -> None:
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, GPU_PYTHON=sys.executable))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("SKIP gpu_check: no CUDA GPU visible to"), out.stdout
    assert "GPU_PYTHON" in out.stdout
    assert not (REPO / ".venv-gpu").exists()

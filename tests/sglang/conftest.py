"""Fixtures of the SGLang plugin tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """.venv-sglang's python (scripts/sglang_venv.sh; stamp-cached, a no-op once built)."""
    subprocess.run(["bash", str(REPO / "scripts" / "sglang_venv.sh")], cwd=REPO, check=True,
                   timeout=540)
    return REPO / ".venv-sglang" / "bin" / "python"


@pytest.fixture(scope="session")
def sglang_root(sglang_python: Path) -> Path:
    """The installed wheel's ``sglang`` directory, found without importing it."""
    out = subprocess.run(
        [str(sglang_python), "-c",
         "import importlib.util; print(importlib.util.find_spec('sglang').origin)"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    return Path(out).parent

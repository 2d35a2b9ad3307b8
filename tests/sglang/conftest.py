"""Fixtures of the SGLang plugin tests."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.sglang import tree_stand_in as stand_in

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


@pytest.fixture
def radix_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """``node_agent.integrations.sglang.radix_cache`` imported against the stand-ins
    of ``tests/sglang/tree_stand_in.py``."""
    spec = SimpleNamespace(speculative_eagle_topk=1)
    stand_ins = {
        "sglang": stand_in.module("sglang"),
        "sglang.srt": stand_in.module("sglang.srt"),
        "sglang.srt.mem_cache": stand_in.module("sglang.srt.mem_cache"),
        "sglang.srt.mem_cache.base_prefix_cache": stand_in.module(
            "sglang.srt.mem_cache.base_prefix_cache", EvictParams=object, EvictResult=object,
            InitLoadBackParams=object, MatchPrefixParams=stand_in.MatchPrefixParams,
            MatchResult=stand_in.MatchResult),
        "sglang.srt.mem_cache.radix_cache": stand_in.module(
            "sglang.srt.mem_cache.radix_cache", RadixCache=stand_in.Tree,
            RadixKey=stand_in.Key, TreeNode=stand_in.Node),
        "sglang.srt.runtime_context": stand_in.module("sglang.srt.runtime_context",
                                                      get_spec=lambda: spec),
    }
    for name, mod in stand_ins.items():
        monkeypatch.setitem(sys.modules, name, mod)
    name = "node_agent.integrations.sglang.radix_cache"
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)

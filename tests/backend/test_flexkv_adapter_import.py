"""FlexKV is optional: importing the adapter never imports it, and a missing FlexKV
fails at construction with an error that names the fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from node_agent.backend.base import KVBackendError
from node_agent.backend.flexkv_adapter import (
    FlexKVBackend,
    FlexKVSettings,
    FlexKVUnavailableError,
)
from node_agent.vocab.layout import KVLayout

REPO = Path(__file__).resolve().parents[2]


def test_module_import_does_not_import_flexkv_and_fake_is_not_visible() -> None:
    """In a fresh interpreter (no test fixture): the adapter imports without flexkv,
    the fake package is not importable, and constructing the backend names the fix."""
    script = textwrap.dedent(
        """
        import importlib.util, sys
        import node_agent.backend.flexkv_adapter as fa
        assert not [m for m in sys.modules if m == "flexkv" or m.startswith("flexkv.")]
        assert importlib.util.find_spec("flexkv") is None, "a flexkv package is visible"
        from node_agent.vocab.layout import KVLayout
        try:
            fa.FlexKVBackend(KVLayout(num_layers=1, num_kv_heads=1, head_size=8),
                             fa.FlexKVSettings(cpu_bytes=1 << 20))
        except fa.FlexKVUnavailableError as exc:
            print("ERROR:", exc)
        else:
            raise SystemExit("FlexKVBackend constructed without flexkv")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert "ERROR: The flexkv backend cannot start: importing FlexKV failed" in out.stdout


def test_missing_flexkv_error_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flexkv", None)  # import flexkv now raises ImportError
    with pytest.raises(FlexKVUnavailableError) as info:
        FlexKVBackend(KVLayout(num_layers=1, num_kv_heads=1, head_size=8),
                      FlexKVSettings(cpu_bytes=1 << 20))
    message = str(info.value)
    assert isinstance(info.value, KVBackendError)
    for needle in ("importing FlexKV failed", "built from source against CUDA",
                   "./build.sh --release", "pip install -e .", "Adding FlexKV to an agent",
                   "`backend: embedded`"):
        assert needle in message

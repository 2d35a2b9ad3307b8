"""Repository layout guarantees: import names and layering."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_operator_folder_does_not_shadow_stdlib_operator() -> None:
    """`operator/` on the path must not replace the standard library module."""
    env = dict(os.environ, PYTHONPATH=".")
    out = subprocess.run(
        [sys.executable, "-c", "import collections, operator; print(operator.__file__)"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(out).resolve().is_relative_to(stdlib), out
    assert not (REPO / "operator" / "__init__.py").exists()


def test_operator_package_imports_under_its_own_name() -> None:
    import flexkv_operator

    assert Path(flexkv_operator.__file__).resolve().is_relative_to(REPO / "operator")


def _imports(folder: Path) -> dict[Path, set[str]]:
    pattern = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_][\w]*)", re.MULTILINE)
    return {p: set(pattern.findall(p.read_text())) for p in folder.rglob("*.py")}


def _node_agent_imports(folder: Path) -> dict[Path, set[str]]:
    """Full module names of every ``node_agent`` import of each file under ``folder``."""
    pattern = re.compile(r"^\s*(?:import|from)\s+(node_agent(?:\.[\w.]+)?)", re.MULTILINE)
    return {p: set(pattern.findall(p.read_text())) for p in folder.rglob("*.py")}


def test_operator_never_imports_data_plane_packages() -> None:
    """The operator imports no torch, no zmq, and of node_agent only the contract
    package (node_agent/contract: the names and rules both sides agree on)."""
    offenders = {
        str(p.relative_to(REPO)): mods & {"torch", "zmq"}
        for p, mods in _imports(REPO / "operator").items()
        if mods & {"torch", "zmq"}
    }
    assert offenders == {}
    runtime = {
        str(p.relative_to(REPO)): sorted(mods)
        for p, mods in _node_agent_imports(REPO / "operator").items()
        if any(m != "node_agent.contract" and not m.startswith("node_agent.contract.")
               for m in mods)
    }
    assert runtime == {}


def test_node_agent_never_imports_kopf() -> None:
    offenders = {
        str(p.relative_to(REPO)): mods & {"kopf", "flexkv_operator"}
        for p, mods in _imports(REPO / "node_agent").items()
        if mods & {"kopf", "flexkv_operator"}
    }
    assert offenders == {}


def test_only_the_sglang_integration_imports_sglang() -> None:
    """SGLang is imported by node_agent/integrations/sglang alone (docs/sglang.md)."""
    sglang_pkg = REPO / "node_agent" / "integrations" / "sglang"
    offenders = {
        str(p.relative_to(REPO)): mods & {"sglang"}
        for p, mods in _imports(REPO / "node_agent").items()
        if "sglang" in mods and not p.is_relative_to(sglang_pkg)
    }
    assert offenders == {}
    importers = {p.name for p, mods in _imports(sglang_pkg).items() if "sglang" in mods}
    assert importers == {"radix_cache.py", "plugin.py"}, importers
    assert all("sglang" not in mods for mods in _imports(REPO / "operator").values())


def test_sglang_plugin_modules_import_without_sglang() -> None:
    """The entry point's module and the connector load in a venv without SGLang; the
    entry point itself then fails with an error that says what to do."""
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('sglang') is None, 'sglang must not be in .venv'\n"
        "import node_agent.integrations.sglang.connector, node_agent.integrations.sglang.kv_pool\n"
        "from node_agent.integrations.sglang import plugin\n"
        "assert 'sglang' not in sys.modules\n"
        "try:\n"
        "    plugin.register()\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert "needs SGLang" in out and "pip install 'sglang==0.5.23'" in out, out
    assert "SGLANG_PLUGINS" in out, out


def test_only_the_vllm_integration_imports_vllm() -> None:
    """vLLM lives in its own venv: no other module may import it, and the
    integration's vLLM-free helpers (config, shared memory) import without it."""
    leaf = REPO / "node_agent" / "integrations" / "vllm"
    offenders = {
        str(p.relative_to(REPO))
        for p, mods in _imports(REPO / "node_agent").items()
        if "vllm" in mods and not p.is_relative_to(leaf)
    }
    assert offenders == set()
    importers = {p.name for p, mods in _imports(leaf).items() if "vllm" in mods}
    assert importers == {"connector.py"}

"""Runtime code imports only what its own extra installs.

Every import statement of ``node_agent`` and ``flexkv_operator`` (module level and
inside functions alike) must name the standard library, the project itself, or
a distribution in the dependency closure of the package's extra (plus the core
dependencies). A ``dev``-only package (httpx, pytest, jsonschema, ...) is the
classic failure: it imports fine in the all-extras .venv and crashes in an
image. tests/test_extras.py runs the commands from single-extra venvs; this
check covers the code paths those runs do not reach.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.operator_imports import (
    CONTRACT,
    PROBE,
    forbidden_modules,
    loaded_contract_modules,
)

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
OWN = {"node_agent", "flexkv_operator"}
# Imported by design without being a dependency: `flexkv` is built from source
# against CUDA and imported only after importlib.util.find_spec finds it; `triton`
# comes with every CUDA build of torch on Linux and is imported only by
# node_agent/backend/_mapped_kernel.py, which mapped_rows imports lazily, on a
# CUDA device, falling back to the staged moves where it fails.
OPTIONAL = {"flexkv", "triton"}
PACKAGES = {
    "node_agent": (REPO / "node_agent", "agent"),
    "flexkv_operator": (REPO / "operator" / "flexkv_operator", "operator"),
}
# Engine adapters run inside their engine's own venv (docs/vllm.md, docs/sglang.md):
# each may import, beyond the agent extra, its engine and what that engine installs.
INTEGRATIONS = REPO / "node_agent" / "integrations"
ENGINE_MODULES = {
    "vllm": {"vllm", "transformers", "tokenizers"},
    "sglang": {"sglang"},
}
# Subpackages that may import, beyond their package's extra, another extra's modules:
# only node_agent/backend/remote imports `mooncake` (the `remote` extra), lazily.
SUBPACKAGE_EXTRAS = {
    Path("node_agent", "backend", "remote"): "remote",
}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(requirements: list[str]) -> set[str]:
    """Distribution names reachable from ``requirements`` (markers without extras honoured)."""
    seen: set[str] = set()
    todo = [_name(r) for r in requirements]
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            reqs = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue
        todo += [_name(r) for r in reqs if "extra ==" not in r.replace('extra=="', 'extra == "')]
    return seen


def _modules_of(dists: set[str]) -> set[str]:
    by_module = md.packages_distributions()
    return {mod for mod, owners in by_module.items()
            if any(o.lower().replace("_", "-") in dists for o in owners)}


def _imports(folder: Path) -> dict[str, set[str]]:
    """Top-level module names imported by each file (relative imports excluded)."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO))] = names
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_runtime_code_imports_only_its_extra(package: str) -> None:
    folder, extra = PACKAGES[package]
    allowed_dists = _closure(PROJECT["dependencies"] + PROJECT["optional-dependencies"][extra])
    allowed = _modules_of(allowed_dists) | set(sys.stdlib_module_names) | OWN | OPTIONAL
    offenders: dict[str, list[str]] = {}
    for path, names in _imports(folder).items():
        parts = Path(path).parts
        engine = parts[2] if parts[:2] == ("node_agent", "integrations") and len(parts) > 3 \
            else None
        extra_ok = ENGINE_MODULES.get(engine, set()) if engine else set()
        for sub, sub_extra in SUBPACKAGE_EXTRAS.items():
            if Path(path).is_relative_to(sub):
                extra_ok = extra_ok | _modules_of(
                    _closure(PROJECT["optional-dependencies"][sub_extra]))
        if names - allowed - extra_ok:
            offenders[path] = sorted(names - allowed - extra_ok)
    assert offenders == {}, (
        f"{package} imports modules that the '{extra}' extra does not install: {offenders}; "
        f"use the standard library or add the distribution to the '{extra}' extra")


def test_every_integration_names_its_engine() -> None:
    """A new engine adapter must say which engine modules it may import."""
    engines = {p.name for p in INTEGRATIONS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert engines == set(ENGINE_MODULES)


def test_the_check_catches_a_dev_only_import() -> None:
    dev_only = _closure(PROJECT["optional-dependencies"]["dev"]) - _closure(
        PROJECT["dependencies"] + PROJECT["optional-dependencies"]["agent"])
    assert "httpx" in dev_only and "httpx" in _modules_of(dev_only)


def test_only_the_remote_subpackage_imports_mooncake() -> None:
    """``mooncake`` is the remote extra's: importing it anywhere else in node_agent
    would make the agent need it without tiers.remote."""
    importers = sorted(p for p, names in _imports(REPO / "node_agent").items()
                       if "mooncake" in names)
    assert importers == ["node_agent/backend/remote/mooncake_client.py"]
    assert "mooncake" not in _modules_of(_closure(
        PROJECT["dependencies"] + PROJECT["optional-dependencies"]["agent"]))


def test_importing_the_operator_loads_no_agent_runtime() -> None:
    """Every operator module imported in a fresh interpreter loads no torch, no zmq and
    of node_agent only the contract package (and node_agent's import-light __init__)."""
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert forbidden_modules(proc.stdout) == []
    assert f"{CONTRACT}.kube" in loaded_contract_modules(proc.stdout)


def test_the_operator_import_probe_catches_an_agent_runtime_import() -> None:
    """The probe's verdict is not vacuous: a loaded runtime module is named."""
    out = json.dumps(["flexkv_operator", "node_agent", f"{CONTRACT}.kube", "node_agent.config",
                      "zmq", "torch.nn"])
    assert forbidden_modules(out) == ["node_agent.config", "zmq", "torch.nn"]

"""Repository layout guarantees: import names and layering."""

from __future__ import annotations

import ast
import os
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


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, fully qualified: top-level, inside functions and
    under ``TYPE_CHECKING`` alike (relative imports resolved)."""
    rel = path.relative_to(REPO)
    package = list(rel.with_suffix("").parts)
    if package[0] == "operator":
        package = package[1:]
    package = package[:-1]  # the package a relative import starts from
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if node.module is None:  # from . import a, b: each is a module
                out.update(f"{module}.{alias.name}" for alias in node.names)
            out.add(module)
    return out


def _imports(folder: Path) -> dict[Path, set[str]]:
    """File -> the top-level names of what it imports (``torch``, ``node_agent``...)."""
    return {p: {m.split(".")[0] for m in _imported_modules(p)} for p in folder.rglob("*.py")}


def _node_agent_imports(folder: Path) -> dict[Path, set[str]]:
    """Full module names of every ``node_agent`` import of each file under ``folder``."""
    return {
        p: {m for m in _imported_modules(p) if m.split(".")[0] == "node_agent"}
        for p in folder.rglob("*.py")
    }


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


# The agent's layers: each unit (a package or a top-level module of node_agent) and
# the units it may import. docs/agent.md ("Layers") shows the same table; a new
# package or module must be placed here before anything imports it.
LAYERS: dict[str, frozenset[str]] = {
    "contract": frozenset(),
    "vocab": frozenset(),
    "metrics": frozenset(),
    "openmp": frozenset(),
    "events": frozenset({"metrics"}),
    "http": frozenset({"metrics"}),
    "pp": frozenset({"contract", "metrics", "vocab"}),
    "engine_api": frozenset({"metrics", "vocab"}),
    "config": frozenset({"backend", "contract", "vocab"}),
    "kube": frozenset({"config", "contract", "vocab"}),
    "backend": frozenset({"config", "contract", "events", "metrics", "vocab"}),
    "coordinator": frozenset({"backend", "metrics", "pp", "vocab"}),
    "client": frozenset({"engine_api", "vocab"}),
    "engine_loads": frozenset({"backend", "client", "vocab"}),
    "integrations": frozenset({"client", "engine_api", "vocab"}),
    "demo": frozenset({"client", "contract", "engine_api", "pp", "vocab"}),
    "assembly": frozenset({"backend", "config", "contract", "coordinator", "engine_api",
                           "events", "metrics", "pp", "vocab"}),
    "agent": frozenset({"node_agent", "assembly", "backend", "config", "engine_api", "events",
                        "http", "kube", "metrics", "vocab"}),
    "__main__": frozenset({"agent", "assembly", "backend", "config", "demo", "openmp"}),
    "node_agent": frozenset(),
}

# Directions that must hold whatever else changes (LAYERS may never allow them).
FORBIDDEN: dict[str, frozenset[str]] = {
    "contract": frozenset(LAYERS) - {"contract"},
    "vocab": frozenset(LAYERS) - {"vocab"},
    "pp": frozenset({"backend", "coordinator"}),
    "engine_api": frozenset({"agent", "assembly", "backend", "coordinator", "pp"}),
    "backend": frozenset({"coordinator", "engine_api", "pp", "http", "kube"}),
    "kube": frozenset({"http"}),
    "events": frozenset({"backend", "coordinator", "engine_api", "pp", "http", "kube"}),
}


def _unit(module: str) -> str | None:
    """The layer unit of a ``node_agent`` module (None for any other module)."""
    parts = module.split(".")
    if parts[0] != "node_agent":
        return None
    return parts[1] if len(parts) > 1 else "node_agent"


def _unit_edges() -> dict[tuple[str, str], set[str]]:
    """(importing unit, imported unit) -> the files that import across units."""
    edges: dict[tuple[str, str], set[str]] = {}
    for path in (REPO / "node_agent").rglob("*.py"):
        rel = path.relative_to(REPO).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        src = _unit(".".join(parts))
        assert src is not None
        for module in _imported_modules(path):
            dst = _unit(module)
            if dst is not None and dst != src:
                edges.setdefault((src, dst), set()).add(str(path.relative_to(REPO)))
    return edges


def test_every_package_and_module_of_the_agent_has_a_layer() -> None:
    units = {p.stem for p in (REPO / "node_agent").glob("*.py") if p.stem != "__init__"}
    units |= {p.name for p in (REPO / "node_agent").iterdir()
              if (p / "__init__.py").exists()}
    units.add("node_agent")
    assert units == set(LAYERS), "place each unit of node_agent in LAYERS (and docs/agent.md)"


def test_imports_follow_the_layers() -> None:
    offenders = {f"{src} -> {dst}": sorted(files) for (src, dst), files in _unit_edges().items()
                 if dst not in LAYERS.get(src, frozenset())}
    assert offenders == {}


def test_the_layers_keep_the_fixed_directions() -> None:
    assert {src: sorted(LAYERS[src] & banned) for src, banned in FORBIDDEN.items()
            if LAYERS[src] & banned} == {}
    assert {src for src, allowed in LAYERS.items() if src in allowed} == set()


def test_the_layers_allow_no_more_than_the_code_uses() -> None:
    """A rule that nothing needs is loosened by accident: every allowed edge is used."""
    used = set(_unit_edges())
    unused = sorted(f"{src} -> {dst}" for src, allowed in LAYERS.items() for dst in allowed
                    if (src, dst) not in used)
    assert unused == []


def test_docs_show_the_layers_the_tests_enforce() -> None:
    """docs/agent.md's "Layers" table lists the same units and imports as LAYERS."""
    text = (REPO / "docs" / "agent.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    documented: dict[str, frozenset[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        allowed = frozenset(c.strip(" `") for c in cells[1].split(",") if c.strip(" `—-"))
        documented[cells[0].strip("`")] = allowed
    assert documented == LAYERS


def test_integrations_alone_import_engines_and_nothing_imports_the_operator() -> None:
    engines = {"vllm", "sglang"}
    integrations = REPO / "node_agent" / "integrations"
    offenders = {str(p.relative_to(REPO)): sorted(mods & engines)
                 for p, mods in _imports(REPO / "node_agent").items()
                 if mods & engines and not p.is_relative_to(integrations)}
    assert offenders == {}


def test_docs_module_table_names_existing_files_and_every_unit() -> None:
    """docs/agent.md's module table names files that exist and covers every unit."""
    text = (REPO / "docs" / "agent.md").read_text()
    table = text.split("| module | job |", 1)[1].split("\n\n", 1)[0]
    paths = [c.strip("`") for line in table.splitlines()[2:]
             for c in line.strip("|").split("|")[0].strip().split(", ")]
    assert [p for p in paths if not (REPO / p).exists()] == []
    covered = {p.split("/")[1].removesuffix(".py") for p in paths if p.startswith("node_agent/")}
    assert set(LAYERS) - {"node_agent"} <= covered, set(LAYERS) - covered

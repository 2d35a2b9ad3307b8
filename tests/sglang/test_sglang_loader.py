"""Import level, against the real SGLang 0.5.23 wheel: SGLang's own
``load_plugins()`` finds this project's ``sglang.srt.plugins`` entry point and its
``register_radix_cache_backend`` accepts the factory. The code runs in
.venv-sglang (scripts/sglang_venv.sh: sglang installed without its CUDA
dependencies); tests/sglang/loader_probe.py says exactly which SGLang modules run
and which two are placeholders."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "sglang" / "loader_probe.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _probe(python: Path, **env: str) -> dict[str, Any]:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    run_env.update(env)
    out = subprocess.run([str(python), str(PROBE)], cwd=REPO, env=run_env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def test_load_plugins_runs_the_entry_point_and_registers_the_backend(
        sglang_python: Path) -> None:
    report = _probe(sglang_python)
    assert report["sglang_version"] == "0.5.23"
    assert ["flexkv-agent", "node_agent.integrations.sglang.plugin:register",
            "flexkv-operator"] in report["entry_points"]
    assert report["registry_imported_by_load_plugins"] is True
    assert report["registered"] == ["flexkv-agent"]
    assert report["factory"] == "node_agent.integrations.sglang.plugin.build_radix_cache"
    # SGLang's registry refuses a second factory under the name; the entry point
    # itself may run again (load_plugins runs once per process, but be safe).
    assert report["duplicate_refused"] == (
        "register_radix_cache_backend: 'flexkv-agent' is already registered")
    assert report["after_second_register"] == ["flexkv-agent"]
    # Registration alone imports no SGLang cache code: that happens in the factory.
    assert report["sglang_imported_by_plugin_module"] is False
    ran = report["sglang_modules_run"]
    for module, path in {
        "sglang.srt.plugins": "sglang/srt/plugins/__init__.py",
        "sglang.srt.plugins.hook_registry": "sglang/srt/plugins/hook_registry.py",
        "sglang.srt.environ": "sglang/srt/environ.py",
        "sglang.srt.mem_cache.registry": "sglang/srt/mem_cache/registry.py",
        "sglang.srt.runtime_context": "sglang/srt/runtime_context.py",
    }.items():
        assert ran.get(module) == path, (module, ran.get(module))
    assert report["placeholders"] == ["sglang.srt.mem_cache.base_prefix_cache",
                                      "sglang.srt.mem_cache.cache_init_params"]


def test_sglang_plugins_whitelist_without_the_plugin_skips_it(sglang_python: Path) -> None:
    report = _probe(sglang_python, SGLANG_PLUGINS="some-other-plugin")
    assert report["registered"] == []
    assert report["factory"] is None
    report = _probe(sglang_python, SGLANG_PLUGINS="some-other-plugin,flexkv-agent")
    assert report["registered"] == ["flexkv-agent"]

"""Run by .venv-sglang's python (scripts/sglang_venv.sh): SGLang 0.5.23's own
plugin loader and radix-cache registry, from the installed wheel, find and
accept the flexkv-agent plugin. Prints one JSON report.

What runs is SGLang's code, unmodified, from the wheel:
``sglang/srt/plugins/__init__.py`` (``load_plugins``, ``load_plugins_by_group``),
``sglang/srt/plugins/hook_registry.py`` (``HookRegistry.apply_hooks``),
``sglang/srt/environ.py`` (``SGLANG_PLUGINS``), ``sglang/srt/mem_cache/registry.py``
(``register_radix_cache_backend``, ``get_radix_cache_factory``,
``registered_radix_cache_backends``), ``sglang/srt/runtime_context.py`` and
``sglang/srt/hardware_backend/mlx/runtime.py`` (imported by the registry).

What does not run, and why:

* ``sglang/__init__.py`` (the frontend language API): it imports
  ``sglang.srt.utils.common`` (triton, a 1 GB CUDA compiler package, PIL) and
  transformers patches. The package object ``sglang`` is created with the wheel's
  directory as its path, so its submodules load from the wheel as usual.
* ``sglang/srt/mem_cache/base_prefix_cache.py`` and ``cache_init_params.py``:
  the registry imports ``BasePrefixCache`` and ``CacheInitParams`` from them for
  type annotations only, and they import the model stack (memory pools,
  attention layers, sgl-kernel/tvm_ffi, transformers) that needs CUDA. They are
  replaced by placeholder modules holding those two names; the report lists them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from importlib.metadata import entry_points, version
from pathlib import Path

PLACEHOLDERS = {
    "sglang.srt.mem_cache.base_prefix_cache": "BasePrefixCache",
    "sglang.srt.mem_cache.cache_init_params": "CacheInitParams",
}


def _prepare() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None, "sglang is not installed here"
    root = Path(spec.origin).parent
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [str(root)]
    sys.modules["sglang"] = pkg
    for name, cls in PLACEHOLDERS.items():
        mod = types.ModuleType(name)
        setattr(mod, cls, type(cls, (), {}))
        mod.__dict__["__placeholder__"] = True
        sys.modules[name] = mod
    return root


def main() -> None:
    root = _prepare()
    from sglang.srt import plugins  # the real loader

    plugins.load_plugins()  # runs the entry point, which imports the real registry
    report_first = "sglang.srt.mem_cache.registry" in sys.modules
    from sglang.srt.mem_cache import registry

    factory = registry.get_radix_cache_factory("flexkv-agent")
    report: dict[str, object] = {
        "sglang_version": version("sglang"),
        "entry_points": [[e.name, e.value, e.dist.name if e.dist else None]
                         for e in entry_points(group=plugins.GENERAL_PLUGINS_GROUP)],
        "registered": registry.registered_radix_cache_backends(),
        "factory": None if factory is None else f"{factory.__module__}.{factory.__qualname__}",
        "placeholders": sorted(PLACEHOLDERS),
        "registry_imported_by_load_plugins": report_first,
    }
    ran = {}
    for name, mod in sorted(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        if name.startswith("sglang.") and file and Path(file).is_relative_to(root):
            ran[name] = str(Path(file).relative_to(root.parent))
    report["sglang_modules_run"] = ran
    if factory is not None:
        # The registry refuses a second factory under the same name (its own check);
        # the plugin's entry point is idempotent when run again.
        from node_agent.integrations.sglang import plugin

        try:
            registry.register_radix_cache_backend("flexkv-agent", lambda ctx: None)
        except ValueError as exc:
            report["duplicate_refused"] = str(exc)
        plugin.register()
        report["after_second_register"] = registry.registered_radix_cache_backends()
        report["sglang_imported_by_plugin_module"] = "sglang.srt.mem_cache.radix_cache" in \
            sys.modules
    print(json.dumps(report))


if __name__ == "__main__":
    main()

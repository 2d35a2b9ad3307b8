"""The SGLang names the plugin's radix cache uses exist in the real 0.5.23 wheel.

``AgentRadixCache`` (node_agent/integrations/sglang/radix_cache.py) cannot be
imported here: SGLang's ``RadixCache`` module pulls in the CUDA model stack. So
this test reads the wheel's source (``ast``, no import) and checks, against it,
every name the plugin imports from SGLang, every method it overrides (each must
be one SGLang defines, or the scheduler would never call it), every attribute and
method it uses on SGLang's objects, and the fields it passes or reads."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "node_agent" / "integrations" / "sglang" / "radix_cache.py"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _top_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
    return names


def _class(path: Path, name: str) -> ast.ClassDef:
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"{name} not defined in {path}")


def _methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def _fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_imported_names_exist_in_the_wheel(sglang_root: Path) -> None:
    for node in ast.walk(_tree(PLUGIN)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang."):
            src = sglang_root.parent / (node.module.replace(".", "/") + ".py")  # type: ignore[union-attr]
            assert src.exists(), src
            missing = {a.name for a in node.names} - _top_names(src)
            assert not missing, (node.module, missing)


def test_overridden_and_used_members_are_sglangs(sglang_root: Path) -> None:
    mem = sglang_root / "srt" / "mem_cache"
    radix = _class(mem / "radix_cache.py", "RadixCache")
    base = _class(mem / "base_prefix_cache.py", "BasePrefixCache")
    sglang_methods = _methods(radix) | _methods(base)
    plugin_cls = _class(PLUGIN, "AgentRadixCache")
    helpers = {"__init__", "_unlock", "_withhold_stuck_slots_on_clear", "_withhold_stuck_slots",
               "slots_in_use"}
    overrides = _methods(plugin_cls) - helpers
    # hicache_storage_pass_prefix_keys is read by the scheduler's storage prefetch path
    # (sglang/srt/managers/scheduler.py) with getattr-free access; SGLang's FlexKV
    # radix cache defines it the same way.
    flexkv = _class(mem / "storage" / "flexkv" / "flexkv_radix_cache.py", "FlexKVRadixCache")
    assert overrides - sglang_methods <= _methods(flexkv), overrides - sglang_methods
    assert {"match_prefix", "init_load_back", "checkpoint", "evict", "check_hicache_events",
            "release_aborted_request", "on_release", "reset"} <= sglang_methods
    # Members used on self that RadixCache / BasePrefixCache must provide.
    used = {n.attr for n in ast.walk(plugin_cls)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self"}
    own = {"flexkv_connector", "_held", "_store_nodes", "_nodes_lock", "_stuck"} | helpers
    radix_src = (mem / "radix_cache.py").read_text() + (mem / "base_prefix_cache.py").read_text()
    for name in sorted(used - own - overrides):
        assert f"self.{name}" in radix_src or f"def {name}" in radix_src, name


def test_the_allocator_members_a_flush_relies_on(sglang_root: Path) -> None:
    """The plugin's allocator ``clear`` wrapper (stuck slots kept out after a flush)
    relies on: ``flush_cache`` resets the tree before it clears the allocator; the
    token and paged allocators' ``clear`` put every page id in a ``free_pages``
    tensor; the base allocator has ``page_size`` and ``clear``."""
    scheduler = (sglang_root / "srt" / "managers" / "scheduler.py").read_text()
    flush = scheduler[scheduler.index("def flush_cache("):]
    assert (flush.index("self.tree_cache.reset()")
            < flush.index("self.token_to_kv_pool_allocator.clear()"))
    alloc = sglang_root / "srt" / "mem_cache" / "allocator"
    base = _class(alloc / "base.py", "BaseTokenToKVPoolAllocator")
    assert {"clear", "alloc", "free", "available_size"} <= _methods(base)
    assert "self.page_size = page_size" in ast.unparse(base)
    for path, name in ((alloc / "token.py", "TokenToKVPoolAllocator"),
                       (alloc / "paged.py", "PagedTokenToKVPoolAllocator")):
        clear = next(n for n in _class(path, name).body
                     if isinstance(n, ast.FunctionDef) and n.name == "clear")
        assert "self.free_pages = torch.arange(" in ast.unparse(clear), name


def test_fields_the_plugin_passes_and_reads(sglang_root: Path) -> None:
    base = sglang_root / "srt" / "mem_cache" / "base_prefix_cache.py"
    assert {"device_prefix_len", "last_device_node", "last_host_node", "best_match_node",
            "host_hit_length"} <= _fields(_class(base, "MatchResult"))
    assert {"best_match_node", "host_hit_length", "req"} <= _fields(
        _class(base, "InitLoadBackParams"))
    assert {"key", "req"} <= _fields(_class(base, "MatchPrefixParams"))
    assert {"num_tokens"} <= _fields(_class(base, "EvictParams"))
    assert {"rid", "attempt_id"} == _fields(_class(base, "CacheRequestHandle"))
    radix_key = _class(sglang_root / "srt" / "mem_cache" / "radix_cache.py", "RadixKey")
    assert {"raw_token_ids", "child_key", "__getitem__", "__len__"} <= _methods(radix_key)
    init = next(n for n in radix_key.body if isinstance(n, ast.FunctionDef)
                and n.name == "__init__")
    assert [a.arg for a in init.args.args][:3] == ["self", "token_ids", "extra_key"]
    assert "cache_salt" in [a.arg for a in init.args.args]


def test_the_server_arguments_the_model_identity_reads_exist(sglang_root: Path) -> None:
    registry = sglang_root / "srt" / "mem_cache" / "registry.py"
    assert "server_args" in _fields(_class(registry, "TreeCacheBuildContext"))
    fields = sglang_root / "srt" / "arg_groups" / "fields"
    declared: set[str] = set()
    for path in fields.glob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                declared.add(node.target.id)
    assert {"model_path", "served_model_name", "revision", "tokenizer_path"} <= declared

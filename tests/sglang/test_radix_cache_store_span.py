"""``AgentRadixCache.checkpoint`` stores only slots its radix lock protects.

A store's source slots must stay owned until the agent reports the store
(``check_completed_stores``): the plugin locks the tree node that the request's
tokens match after SGLang's own ``checkpoint`` inserted them, and unlocks it when
the store is reported. Slots outside that node's path are the request's own
and SGLang frees them when the request ends, maybe while the agent still copies
them: the stored block would then hold another request's KV.

With EAGLE (``is_eagle``) SGLang 0.5.23 keys its tree by bigrams
(``RadixKey.__len__`` is one less than the raw token count), so the tree, and the
node the plugin locks, cover the page-aligned ``committed - 1`` tokens; a
request whose committed length is a whole number of pages has its last page
outside the tree.

SGLang's ``RadixCache`` module cannot be imported here (it pulls in its CUDA
kernels), so the SGLang names the plugin imports are stood in for by
:class:`_Tree`, which models only what this test needs from 0.5.23's
``sglang/srt/mem_cache/radix_cache.py``: ``checkpoint`` inserts the page-aligned
(bigram under EAGLE) key, ``match_prefix`` answers the matched page-aligned
length of the (bigram) key, and ``inc_lock_ref`` / ``dec_lock_ref`` lock a
node's path. ``tests/sglang/test_sglang_api_surface.py`` checks the plugin's use
of those names against the real wheel.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

PAGE = 16


@dataclass
class _Key:
    """SGLang's ``RadixKey``: raw tokens; a bigram key is one shorter."""

    token_ids: list[int]
    extra_key: Any = None
    is_bigram: bool = False
    cache_salt: Any = None

    def __len__(self) -> int:
        n = len(self.token_ids)
        return max(n - 1, 0) if self.is_bigram else n


@dataclass
class _Node:
    length: int
    """Tokens on the node's path from the root (the slots its lock protects)."""


@dataclass
class _MatchPrefixParams:
    key: _Key
    req: Any = None


@dataclass
class _MatchResult:
    device_prefix_len: int
    last_device_node: Any
    last_host_node: Any = None
    best_match_node: Any = None
    host_hit_length: int = 0


class _Tree:
    """Stand-in of SGLang 0.5.23's ``RadixCache`` (see module docstring)."""

    def __init__(self, params: Any) -> None:
        self.page_size = params.page_size
        self.is_eagle = params.is_eagle
        self.disable = False
        self.token_to_kv_pool_allocator = params.allocator
        self.req_to_token_pool = params.req_to_token_pool
        self.cached: list[int] = []
        self.locked: dict[int, int] = {}

    def reset(self) -> None:
        self.cached = []

    def _aligned(self, key: _Key) -> int:
        return len(key) // self.page_size * self.page_size

    def checkpoint(self, req: Any, *, up_to: int) -> None:
        tokens = (req.origin_input_ids + req.output_ids)[:up_to]
        key = _Key(tokens, is_bigram=self.is_eagle)
        self.cached = tokens[:self._aligned(key) + (1 if self.is_eagle else 0)]

    def match_prefix(self, params: _MatchPrefixParams) -> _MatchResult:
        key = params.key
        key.is_bigram = self.is_eagle  # SGLang's maybe_to_bigram_view
        common = 0
        for a, b in zip(key.token_ids, self.cached, strict=False):
            if a != b:
                break
            common += 1
        matched = min(common - 1 if self.is_eagle else common, len(key))
        matched = max(matched, 0) // self.page_size * self.page_size
        return _MatchResult(matched, _Node(matched))

    def inc_lock_ref(self, node: _Node) -> None:
        self.locked[id(node)] = node.length

    def dec_lock_ref(self, node: _Node) -> None:
        self.locked.pop(id(node))


class _Connector:
    """Records ``store_kv``; every store is in flight until the test says otherwise."""

    def __init__(self) -> None:
        self.stores: list[tuple[list[int], list[int]]] = []

    def store_kv(self, handle: Any, token_ids: list[int], kv_indices: torch.Tensor) -> int:
        self.stores.append((list(token_ids), kv_indices.tolist()))
        return len(self.stores)

    def check_completed_stores(self) -> list[Any]:
        return []


def _module(name: str, **members: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for key, value in members.items():
        setattr(mod, key, value)
    return mod


@pytest.fixture
def radix_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """``node_agent.integrations.sglang.radix_cache`` imported against the stand-ins."""
    spec = SimpleNamespace(speculative_eagle_topk=1)
    stand_ins = {
        "sglang": _module("sglang"),
        "sglang.srt": _module("sglang.srt"),
        "sglang.srt.mem_cache": _module("sglang.srt.mem_cache"),
        "sglang.srt.mem_cache.base_prefix_cache": _module(
            "sglang.srt.mem_cache.base_prefix_cache", EvictParams=object, EvictResult=object,
            InitLoadBackParams=object, MatchPrefixParams=_MatchPrefixParams,
            MatchResult=_MatchResult),
        "sglang.srt.mem_cache.radix_cache": _module(
            "sglang.srt.mem_cache.radix_cache", RadixCache=_Tree, RadixKey=_Key, TreeNode=_Node),
        "sglang.srt.runtime_context": _module("sglang.srt.runtime_context",
                                              get_spec=lambda: spec),
    }
    for name, mod in stand_ins.items():
        monkeypatch.setitem(sys.modules, name, mod)
    name = "node_agent.integrations.sglang.radix_cache"
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)


def _checkpoint(module: types.ModuleType, *, eagle: bool, page: int,
                committed: int) -> tuple[_Tree, _Connector]:
    connector = _Connector()
    rows = torch.arange(1000, 1000 + 4 * PAGE, dtype=torch.int64).reshape(1, -1)
    params = SimpleNamespace(
        page_size=page, is_eagle=eagle,
        allocator=SimpleNamespace(get_kvcache=lambda: None),
        req_to_token_pool=SimpleNamespace(req_to_token=rows))
    cache = module.AgentRadixCache(params, lambda _pool: connector)
    req = SimpleNamespace(
        origin_input_ids=list(range(100, 100 + PAGE)),
        output_ids=list(range(500, 500 + committed - PAGE)),
        extra_key=None, cache_salt=None, cache_request_handle="req-1",
        kv=SimpleNamespace(kv_committed_len=committed, req_pool_idx=0),
        finished=lambda: True)
    cache.checkpoint(req, up_to=committed)
    return cache, connector


@pytest.mark.parametrize(("eagle", "page"), [(False, PAGE), (True, PAGE), (True, 1)])
def test_a_store_reads_only_slots_its_radix_lock_protects(
        radix_cache: types.ModuleType, eagle: bool, page: int) -> None:
    cache, connector = _checkpoint(radix_cache, eagle=eagle, page=page, committed=2 * PAGE)
    assert len(connector.stores) == 1
    tokens, slots = connector.stores[0]
    assert len(tokens) == len(slots)
    (locked,) = cache.locked.values()
    assert 0 < len(slots) <= locked, (
        f"the store reads {len(slots)} slots but the radix lock held until the agent "
        f"reports it protects the first {locked}")
    assert slots == list(range(1000, 1000 + len(slots)))
    assert tokens == (list(range(100, 100 + PAGE)) + list(range(500, 500 + PAGE)))[:len(slots)]
    expected = 2 * PAGE if not eagle else (2 * PAGE - 1) // page * page
    assert len(slots) == expected


def test_nothing_is_stored_when_the_tree_holds_no_whole_page(
        radix_cache: types.ModuleType) -> None:
    """EAGLE with one committed page: the bigram key is one token short of a page."""
    cache, connector = _checkpoint(radix_cache, eagle=True, page=PAGE, committed=PAGE)
    assert connector.stores == []
    assert cache.locked == {}

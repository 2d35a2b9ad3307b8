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
``tests/sglang/tree_stand_in.py`` (the ``radix_cache`` fixture).
"""

from __future__ import annotations

import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.sglang.tree_stand_in import Tree

PAGE = 16


class _Connector:
    """Records ``store_kv``; every store is in flight until the test says otherwise."""

    def __init__(self) -> None:
        self.stores: list[tuple[list[int], list[int]]] = []

    def store_kv(self, handle: Any, token_ids: list[int], kv_indices: torch.Tensor) -> int:
        self.stores.append((list(token_ids), kv_indices.tolist()))
        return len(self.stores)

    def check_completed_stores(self) -> list[Any]:
        return []


def _checkpoint(module: types.ModuleType, *, eagle: bool, page: int,
                committed: int) -> tuple[Tree, _Connector]:
    connector = _Connector()
    rows = torch.arange(1000, 1000 + 4 * PAGE, dtype=torch.int64).reshape(1, -1)
    params = SimpleNamespace(
        page_size=page, is_eagle=eagle,
        allocator=SimpleNamespace(get_kvcache=lambda: None, clear=lambda: None),
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

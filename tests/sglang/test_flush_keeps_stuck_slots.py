"""A cache flush does not hand out the slots of a load the agent could not stop.

When the agent's copy into a request's slots does not stop (a hung device),
``retrieve_kv`` answers ``SLOTS_IN_USE`` and ``AgentRadixCache`` keeps those slots
allocated for the engine's life. SGLang's ``flush_cache`` resets the tree and then
clears the whole token-to-KV allocator, which puts every slot back on its free
list; the plugin's clear takes the stuck ones back out, so no later request is
given slots the copy may still write.

The tree is the stand-in of ``tests/sglang/tree_stand_in.py``; :class:`_Allocator`
models the part of SGLang 0.5.23's token (page size 1) and paged allocators that
this touches: a ``free_pages`` tensor of page ids, all of them free after
``clear``, and pages handed out from its front (``test_sglang_api_surface`` checks
those names against the wheel)."""

from __future__ import annotations

import logging
import types
from collections.abc import Hashable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.sglang.tree_stand_in import Key, Node


class _Allocator:
    """Page ids ``1..pages`` (0 is SGLang's padding page); slots are page * size + i."""

    def __init__(self, pages: int, page_size: int) -> None:
        self.pages = pages
        self.page_size = page_size
        self.free_pages = torch.empty(0, dtype=torch.int64)
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.pages + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, need: int) -> torch.Tensor | None:
        n = need // self.page_size
        if n > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return (out[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        self.free_pages = torch.cat((self.free_pages, torch.unique(slots // self.page_size)))

    def get_kvcache(self) -> None:
        return None


class _Connector:
    """Answers ``retrieve_kv`` with the code the test sets."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.retrieved: list[list[int]] = []

    def retrieve_kv(self, handle: Hashable, slots: torch.Tensor) -> int:
        self.retrieved.append(slots.tolist())
        return self.answer

    def release_pending(self, handle: Hashable) -> None:
        pass

    def reset(self) -> list[Hashable]:
        return []


def _cache(module: types.ModuleType, allocator: Any, answer: int) -> tuple[Any, _Connector]:
    connector = _Connector(answer)
    params = SimpleNamespace(page_size=getattr(allocator, "page_size", 1), is_eagle=False,
                             allocator=allocator, req_to_token_pool=None)
    return module.AgentRadixCache(params, lambda _pool: connector), connector


def _load(cache: Any, rid: str, tokens: int) -> int:
    """One host hit of ``tokens`` tokens loaded into freshly allocated slots."""
    req = SimpleNamespace(rid=rid, cache_request_handle=rid)
    cache._held[rid] = (Key(list(range(tokens))), 0)
    loaded, _ = cache.init_load_back(SimpleNamespace(
        req=req, best_match_node=Node(0), host_hit_length=tokens))
    return int(loaded)


def _flush(cache: Any) -> None:
    """What SGLang 0.5.23's ``Scheduler.flush_cache`` does to the two: reset the tree,
    then clear the allocator."""
    cache.reset()
    cache.token_to_kv_pool_allocator.clear()


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_flush_keeps_the_slots_of_a_stuck_load_out_of_the_free_list(
        radix_cache: types.ModuleType, page_size: int) -> None:
    allocator = _Allocator(pages=256 // page_size, page_size=page_size)
    cache, connector = _cache(radix_cache, allocator, radix_cache.SLOTS_IN_USE)
    assert _load(cache, "stuck", 64) == 0
    stuck = set(connector.retrieved[0])
    assert len(stuck) == 64 and cache.slots_in_use == 64
    _flush(cache)
    assert allocator.available_size() == 256 - 64
    handed_out = allocator.alloc(allocator.available_size())
    assert handed_out is not None
    assert not stuck & set(handed_out.tolist()), "a flush gave stuck slots to a new request"
    # A second flush keeps them out too.
    _flush(cache)
    assert allocator.available_size() == 256 - 64


def test_a_flush_with_no_stuck_load_frees_every_slot(radix_cache: types.ModuleType) -> None:
    """Loads that ended (hit or miss) leave the allocator's clear as SGLang's."""
    allocator = _Allocator(pages=16, page_size=16)
    cache, _ = _cache(radix_cache, allocator, 0)
    assert _load(cache, "miss", 64) == 0
    assert allocator.available_size() == 256  # a miss frees its slots at once
    allocator.alloc(128)
    _flush(cache)
    assert allocator.available_size() == 256


def test_an_allocator_without_a_page_list_logs_that_the_engine_must_restart(
        radix_cache: types.ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    """An allocator this does not know (no ``free_pages`` tensor) is left as it is,
    and the error names it and the fix."""
    allocator = _Allocator(pages=16, page_size=16)
    cache, _ = _cache(radix_cache, allocator, radix_cache.SLOTS_IN_USE)
    assert _load(cache, "stuck", 32) == 0
    allocator.clear = lambda: setattr(allocator, "free_pages", None)  # type: ignore[method-assign]
    cache._withhold_stuck_slots_on_clear()
    with caplog.at_level(logging.ERROR):
        _flush(cache)
    assert "restart the engine and the agent" in caplog.text
    assert any(getattr(r, "allocator", None) == "_Allocator" for r in caplog.records)

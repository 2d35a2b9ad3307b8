"""A stand-in of the SGLang 0.5.23 names ``AgentRadixCache`` imports, for tests that
drive the plugin without SGLang (its ``RadixCache`` module pulls in its CUDA
kernels). It models only what those tests need from
``sglang/srt/mem_cache/radix_cache.py``: ``checkpoint`` inserts the page-aligned
(bigram under EAGLE) key, ``match_prefix`` answers the matched page-aligned length
of the (bigram) key, and ``inc_lock_ref`` / ``dec_lock_ref`` lock a node's path.
``tests/sglang/test_sglang_api_surface.py`` checks the plugin's use of those names
against the real wheel. The ``radix_cache`` fixture (``conftest.py``) imports the
plugin against these."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any


@dataclass
class Key:
    """SGLang's ``RadixKey``: raw tokens; a bigram key is one shorter."""

    token_ids: list[int]
    extra_key: Any = None
    is_bigram: bool = False
    cache_salt: Any = None

    def __len__(self) -> int:
        n = len(self.token_ids)
        return max(n - 1, 0) if self.is_bigram else n


@dataclass
class Node:
    length: int
    """Tokens on the node's path from the root (the slots its lock protects)."""


@dataclass
class MatchPrefixParams:
    key: Key
    req: Any = None


@dataclass
class MatchResult:
    device_prefix_len: int
    last_device_node: Any
    last_host_node: Any = None
    best_match_node: Any = None
    host_hit_length: int = 0


class Tree:
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

    def _aligned(self, key: Key) -> int:
        return len(key) // self.page_size * self.page_size

    def checkpoint(self, req: Any, *, up_to: int) -> None:
        tokens = (req.origin_input_ids + req.output_ids)[:up_to]
        key = Key(tokens, is_bigram=self.is_eagle)
        self.cached = tokens[:self._aligned(key) + (1 if self.is_eagle else 0)]

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        key.is_bigram = self.is_eagle  # SGLang's maybe_to_bigram_view
        common = 0
        for a, b in zip(key.token_ids, self.cached, strict=False):
            if a != b:
                break
            common += 1
        matched = min(common - 1 if self.is_eagle else common, len(key))
        matched = max(matched, 0) // self.page_size * self.page_size
        return MatchResult(matched, Node(matched))

    def inc_lock_ref(self, node: Node) -> None:
        self.locked[id(node)] = node.length

    def dec_lock_ref(self, node: Node) -> None:
        self.locked.pop(id(node))


def module(name: str, **members: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for key, value in members.items():
        setattr(mod, key, value)
    return mod

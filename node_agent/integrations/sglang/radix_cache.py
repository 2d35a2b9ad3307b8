"""The radix cache SGLang builds for ``--radix-cache-backend flexkv-agent``.

This module imports SGLang at import time; only the backend factory in
:mod:`node_agent.integrations.sglang.plugin` imports it, inside an SGLang
scheduler process. It extends SGLang 0.5.23's ``RadixCache``
(``sglang/srt/mem_cache/radix_cache.py``) with the host-tier calls SGLang's own
``FlexKVRadixCache`` makes (``sglang/srt/mem_cache/storage/flexkv/
flexkv_radix_cache.py``, synchronous "MP" mode), against
:class:`~node_agent.integrations.sglang.connector.AgentKVConnector` instead of a
``FlexKVConnector``:

* ``match_prefix``: the key is cut to whole pages, the device match runs, then
  ``lookup_kv`` over the tokens not on the device; a hit becomes
  ``MatchResult.host_hit_length`` and the key is snapshotted for the load.
* ``init_load_back``: allocates ``host_hit_length`` slots, ``retrieve_kv``; a
  full load becomes a new tree node, anything else frees the slots and loads 0
  (the connector never returns a partial load), except a load the agent could
  not stop (``SLOTS_IN_USE``): its slots are never freed (``slots_in_use``), and
  a cache flush, which clears the whole allocator, takes them back out of its
  free list.
* ``checkpoint`` of a finished request: ``store_kv`` of the committed tokens
  that the tree holds after SGLang's own ``checkpoint`` (the slots of its
  matched node: with EAGLE's bigram keys, one token less than committed, cut to
  whole pages); the matched node stays locked until ``check_completed_stores``
  returns the request's handle (drained every tick by ``check_hicache_events`` when SGLang
  runs with ``--enable-flexkv``, and before every ``evict``).
* aborts (``release_aborted_request``), ``reset`` (``flush_cache``) and
  ``shutdown``.

Keys carrying a LoRA ``extra_key`` or a ``cache_salt`` are served from the
device tree only: the engine API's lookups carry no namespace, so such prefixes
must never reach the shared cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
from sglang.srt.runtime_context import get_spec

from node_agent.integrations.sglang.connector import SLOTS_IN_USE, AgentKVConnector

log = logging.getLogger(__name__)


class AgentRadixCache(RadixCache):
    """SGLang's radix cache with the node agent as its host tier."""

    def __init__(self, params: Any,
                 connector_factory: Callable[[Any], AgentKVConnector]) -> None:
        super().__init__(params)
        self._held: dict[Hashable, tuple[Any, int]] = {}
        self._store_nodes: dict[Hashable, Any] = {}
        self._nodes_lock = threading.Lock()
        self._stuck: list[torch.Tensor] = []
        """The slots of each load the agent could not stop: allocated, never freed."""
        self.flexkv_connector = connector_factory(self.token_to_kv_pool_allocator.get_kvcache())
        self._withhold_stuck_slots_on_clear()

    @property
    def slots_in_use(self) -> int:
        """Slots of loads the agent could not stop (kept out of use for the engine's life)."""
        return sum(len(s) for s in self._stuck)

    # -- lookup -------------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if self.disable or not key:
            return super().match_prefix(params)
        base = super().match_prefix(params)
        req = params.req
        if req is None or key.extra_key is not None or key.cache_salt is not None:
            return base
        whole = (len(key) // self.page_size) * self.page_size
        if whole == 0 or getattr(key, "is_bigram", False):
            return base
        key = key[:whole]
        token_ids = np.asarray(key.raw_token_ids(), dtype=np.int64)
        device_len = int(base.device_prefix_len)
        if device_len >= len(token_ids):
            return base
        mask = np.zeros(len(token_ids), dtype=bool)
        mask[device_len:] = True
        _, hit = self.flexkv_connector.lookup_kv(token_ids, mask, req.cache_request_handle)
        if hit <= 0:
            return base
        # The live key aliases req.fill_ids, which keeps growing; the cut key holds a
        # slice (a copy of the same sequence type: RadixKey.match_at asserts that the
        # keys it compares store their tokens in the same type).
        self._held[req.cache_request_handle] = (key, device_len)
        node = base.last_device_node
        return MatchResult(device_prefix_len=device_len, last_device_node=node,
                           last_host_node=node, best_match_node=node, host_hit_length=hit)

    # -- load ---------------------------------------------------------------------------

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any]:
        req = params.req
        last_node = params.best_match_node
        held = self._held.pop(req.cache_request_handle, None)
        want = int(params.host_hit_length)
        if held is None or want <= 0:
            self.flexkv_connector.release_pending(req.cache_request_handle)
            return 0, last_node
        key, device_len = held
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < want:
            self.evict(EvictParams(num_tokens=want))
        slots = allocator.alloc(want)
        if slots is None:
            self.flexkv_connector.release_pending(req.cache_request_handle)
            return 0, last_node
        loaded = self.flexkv_connector.retrieve_kv(req.cache_request_handle,
                                                   slots.to(torch.int64))
        if loaded == SLOTS_IN_USE:
            # The agent's copy may still write these slots: never free them (they
            # stay allocated, out of every tree and free list, until the process ends).
            self._stuck.append(slots.detach().to(torch.int64).clone())
            log.error("Slots of a load the agent could not stop are kept out of use",
                      extra={"rid": req.rid, "slots": want, "total": self.slots_in_use})
            return 0, last_node
        if loaded != want:  # 0: the connector never answers a partial load
            allocator.free(slots)
            return 0, last_node
        node = TreeNode(priority=last_node.priority)
        node.key = key[device_len:device_len + want]
        node.value = slots
        node.parent = last_node
        last_node.children[node.key.child_key(self.page_size)] = node
        self.evictable_size_ += want
        self._update_leaf_status(last_node)
        self._update_leaf_status(node)
        self.kv_events.record_store(last_node)
        self.kv_events.record_store(node)
        return want, node

    # -- store --------------------------------------------------------------------------

    def checkpoint(self, req: Any, *, up_to: int) -> None:
        super().checkpoint(req, up_to=up_to)
        if not req.finished() or req.extra_key is not None or req.cache_salt is not None:
            return
        topk = get_spec().speculative_eagle_topk
        if topk is None or topk == 1:
            committed = req.kv.kv_committed_len
        else:
            committed = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
        committed = min(committed, up_to)
        token_ids = (req.origin_input_ids + req.output_ids)[:committed]
        if not token_ids:
            return
        match = super().match_prefix(MatchPrefixParams(
            key=RadixKey(token_ids, req.extra_key, cache_salt=req.cache_salt)))
        node = match.last_device_node
        # Only the matched path is locked until the agent reports the store; slots
        # past it are the request's own, freed when it ends (with EAGLE the tree's
        # bigram keys cover one token less than the request), so they are not stored.
        locked = min(committed, int(match.device_prefix_len))
        if node is None or locked <= 0:
            return
        token_ids = token_ids[:locked]
        kv_indices = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :locked]
        self.inc_lock_ref(node)
        try:
            task_id = self.flexkv_connector.store_kv(req.cache_request_handle,
                                                     list(token_ids), kv_indices)
        except Exception:
            self.dec_lock_ref(node)
            raise
        if task_id < 0:
            self.dec_lock_ref(node)
            return
        with self._nodes_lock:
            self._store_nodes[req.cache_request_handle] = node

    def _unlock(self, handles: list[Hashable]) -> None:
        with self._nodes_lock:
            nodes = [self._store_nodes.pop(h, None) for h in handles]
        for node in nodes:
            if node is not None:
                self.dec_lock_ref(node)

    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        # Stores reported complete no longer read their slots: unlock before evicting.
        self._unlock(self.flexkv_connector.check_completed_stores())
        return super().evict(params)

    def check_hicache_events(self) -> None:
        self._unlock(self.flexkv_connector.check_completed_stores())

    # -- request end, flush, exit ------------------------------------------------------

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        if not checkpointed:
            self._held.pop(req.cache_request_handle, None)

    def release_aborted_request(self, handle: Hashable) -> None:
        self._held.pop(handle, None)
        self.flexkv_connector.release_pending(handle)
        # The aborted request's store (if any) keeps its lock until the agent
        # reports it: its source slots may still be read.

    def reset(self) -> None:
        super().reset()
        if hasattr(self, "flexkv_connector"):  # RadixCache.__init__ calls reset first
            self._held.clear()
            self.flexkv_connector.reset()
            with self._nodes_lock:
                self._store_nodes.clear()

    def _withhold_stuck_slots_on_clear(self) -> None:
        """Make the allocator's ``clear`` keep the slots of stuck loads out of its free
        list. SGLang's ``flush_cache`` resets this tree, then clears the whole
        token-to-KV allocator, which would hand those slots to the next request while
        the agent's copy may still write them; the tree's ``reset`` runs before that
        clear, so only the clear itself can take them back out."""
        allocator = self.token_to_kv_pool_allocator
        clear = allocator.clear

        def clear_withholding_stuck_slots() -> None:
            clear()
            self._withhold_stuck_slots(allocator)

        allocator.clear = clear_withholding_stuck_slots

    def _withhold_stuck_slots(self, allocator: Any) -> None:
        """Remove the pages of stuck loads from a just-cleared ``allocator``'s free list
        (SGLang 0.5.23's token and paged allocators: ``free_pages``, page ids, every
        page free after ``clear``)."""
        if not self._stuck:
            return
        free = getattr(allocator, "free_pages", None)
        page = int(getattr(allocator, "page_size", 1) or 1)
        if not isinstance(free, torch.Tensor) or free.dim() != 1:
            log.error("Cache flush returned the slots of loads the agent could not stop to "
                      "the allocator; restart the engine and the agent before serving more",
                      extra={"allocator": type(allocator).__name__,
                             "slots": self.slots_in_use})
            return
        pages = torch.unique(torch.cat(self._stuck) // page).to(free.device)
        allocator.free_pages = free[~torch.isin(free, pages)]
        log.warning("Cache flush kept the slots of loads the agent could not stop out of use",
                    extra={"slots": self.slots_in_use, "pages": len(pages)})

    def shutdown(self) -> None:
        if hasattr(self, "flexkv_connector"):
            self.flexkv_connector.shutdown()

    @property
    def hicache_storage_pass_prefix_keys(self) -> bool:
        return False

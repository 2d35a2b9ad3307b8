"""One backend (tiers and index) shared by the single-stage replicas of one model.

With ``maxStages`` > 1 an agent serves several stages. The stages of one-stage
groups (``ppSize`` 1) whose KV is interchangeable share one
:class:`~.embedded.EmbeddedBackend`, so a prefix one replica stored is a hit for
the others, also after the storing replica's engine is gone. Interchangeable
means the same :class:`Fingerprint`: model identity (the hash namespace made of
the engine's model digest and the pool's ``modelSalt``), layout (dtype, tokens
per block, layer and head shapes, TP size) and PP rank and size. A stage without
a model identity never shares: another model of the same layout could not be
told apart from it.

Each stage joins as a *tenant* (:class:`SharedBackends.join`) and gets a
:class:`SharedStageBackend`, the :class:`~.replication.ReplicatedBackend` its
connector drives:

* its tasks copy from / to its own engine buffers (``register_kv_buffers`` keeps
  them per tenant) and only it launches them;
* its completion listener hears only its own tasks;
* ``stats`` are the shared tiers' capacity and use with its own lookups and hits;
* ``shutdown`` ends its own tasks and forgets its buffers (a call of its stage
  still in flight then matches nothing and launches nothing); the backend itself is
  shut down when its last tenant leaves, so the blocks a replica stored stay
  cached while any other replica of the model is served;
* ``reset`` flushes the shared index only for a cache-epoch change (the first
  tenant reset after the agent's ``cacheEpoch`` moved does it, once); otherwise
  it ends that tenant's own tasks and leaves every cached block to the others.
  Until the flush ran, matches answer a miss / "nothing stored", so no tenant is
  served a block of the old epoch.

Eviction is one LRU over the blocks of every tenant (the backend's own,
leaf-first); blocks a task loads or stores are pinned by that task, whichever
tenant evicts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from node_agent.backend.base import (
    BackendStats,
    BoolMask,
    KVResponse,
    MatchOp,
    SlotArray,
    TokenArray,
)
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.replication import ReplicatedBackend
from node_agent.vocab.layout import KVLayout
from node_agent.vocab.placement import TierMove, TransferPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fingerprint:
    """What makes the KV of two stages interchangeable (see module docstring)."""

    namespace: str
    """The model identity: the engine's model digest with the pool's ``modelSalt``."""
    layout: KVLayout
    pp_rank: int
    pp_size: int


@dataclass(eq=False)
class _Entry:
    """One shared backend and its tenants (tenant id -> replica)."""

    fingerprint: Fingerprint
    backend: EmbeddedBackend
    content_epoch: int
    """The cache epoch the backend holds blocks of (set by each flush)."""
    tenants: dict[int, str] = field(default_factory=dict)
    reset_lock: threading.Lock = field(default_factory=threading.Lock)


class SharedBackends:
    """The agent's shared backends, by fingerprint. Thread-safe.

    ``key_epoch()`` is the agent's current ``cacheEpoch`` (switched before the
    flush that applies it)."""

    def __init__(self, key_epoch: Callable[[], int]) -> None:
        self.key_epoch = key_epoch
        self._lock = threading.Lock()
        self._entries: dict[Fingerprint, _Entry] = {}
        self._next_tenant = 1

    def join(self, fingerprint: Fingerprint, replica: str,
             build: Callable[[], EmbeddedBackend]) -> SharedStageBackend:
        """The stage of ``replica`` joins the backend of ``fingerprint``; the first
        stage builds it (``build()``, started here) and it holds blocks of the
        cache epoch current now. Raises what ``build`` or ``start`` raise."""
        with self._lock:
            entry = self._entries.get(fingerprint)
            if entry is None:
                epoch = self.key_epoch()
                backend = build()
                backend.start()
                entry = _Entry(fingerprint, backend, epoch)
                self._entries[fingerprint] = entry
                log.info("Shared backend started", extra={"replica": replica})
            tenant = self._next_tenant
            self._next_tenant += 1
            entry.tenants[tenant] = replica
            entry.backend.add_tenant(tenant, replica)
        log.info("Stage joined a shared backend", extra={
            "replica": replica, "replicas": sorted(entry.tenants.values())})
        return SharedStageBackend(self, entry, tenant, replica)

    def leave(self, entry: _Entry, tenant: int) -> None:
        """``tenant`` leaves ``entry``: its tasks end and its buffers are forgotten;
        the last tenant to leave shuts the backend down."""
        try:
            entry.backend.remove_tenant(tenant)
        finally:
            with self._lock:
                replica = entry.tenants.pop(tenant, None)
                last = not entry.tenants
                if last and self._entries.get(entry.fingerprint) is entry:
                    del self._entries[entry.fingerprint]
                if last:
                    # Under the lock: a stage joining this fingerprint now builds a
                    # new backend only once this one released its tiers.
                    entry.backend.shutdown()
            log.info("Stage left a shared backend", extra={
                "replica": replica, "last": last})

    def shared_with(self, entry: _Entry) -> list[str]:
        """The replicas of ``entry``'s tenants now, sorted."""
        with self._lock:
            return sorted(entry.tenants.values())


class SharedStageBackend(ReplicatedBackend):
    """One stage's view of a shared :class:`EmbeddedBackend` (see module docstring)."""

    def __init__(self, owner: SharedBackends, entry: _Entry, tenant: int,
                 replica: str) -> None:
        self._owner = owner
        self.entry = entry
        """The shared backend this stage is a tenant of (its identity dedupes totals)."""
        self.tenant = tenant
        self.replica = replica
        self.backend = entry.backend
        self.tokens_per_block = entry.backend.tokens_per_block
        self._left = False
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Nothing to start: the shared backend started when its first tenant joined."""

    def is_ready(self) -> bool:
        return not self._left and self.backend.is_ready_for(self.tenant)

    def shutdown(self) -> None:
        """Leave the shared backend (its last tenant shuts it down). Idempotent."""
        with self._lock:
            if self._left:
                return
            self._left = True
        self._owner.leave(self.entry, self.tenant)

    def reset(self) -> None:
        """A flush of the whole shared backend when the agent's cache epoch moved
        since its last flush; else only this tenant's tasks end (see module
        docstring). Raises ``KVBackendError`` when a copy does not stop."""
        entry = self.entry
        with entry.reset_lock:
            epoch = self._owner.key_epoch()
            if entry.content_epoch != epoch:
                self.backend.reset()
                entry.content_epoch = epoch
                log.info("Shared backend flushed for a new cache epoch", extra={
                    "replica": self.replica, "epoch": epoch})
                return
        self.backend.end_tenant_tasks(self.tenant, "its stage was reset")

    def register_kv_buffers(self, rank: int, buffers: Sequence[Sequence[torch.Tensor]]) -> None:
        self.backend.register_for(self.tenant, rank, buffers)

    def stats(self) -> BackendStats:
        return self.backend.stats_for(self.tenant)

    def status(self) -> dict[str, Any]:
        """``/status``'s ``sharedBackend`` of the stage: the replicas sharing it,
        the blocks this replica's puts created that are cached now, and its hit
        blocks that another replica stored."""
        return {"replicas": self._owner.shared_with(self.entry),
                **self.backend.tenant_share(self.tenant)}

    # -- the FlexKV contract, for this tenant ---------------------------------

    def _match(self, op: MatchOp, tokens: TokenArray, token_mask: BoolMask | None,
               namespace: str | None) -> tuple[int, BoolMask]:
        if self.entry.content_epoch != self._owner.key_epoch():
            # The cache epoch moved and the shared backend is not flushed yet: its
            # blocks belong to the old epoch.
            return -1, np.zeros(len(tokens), dtype=bool)
        return self.backend.match_for(self.tenant, op, tokens, token_mask, namespace)

    def _launch(self, ids: list[int], slot_mappings: Sequence[SlotArray],
                as_batch: bool) -> list[int]:
        return self.backend.launch_for(self.tenant, ids, slot_mappings, as_batch)

    def _wait(self, ids: list[int], timeout: float, completely: bool) -> dict[int, KVResponse]:
        return self.backend.wait(ids, timeout, completely)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, KVResponse]:
        return self.backend.try_wait(task_ids)

    def set_completion_listener(self, listener: Callable[[], None] | None) -> None:
        self.backend.set_listener_for(self.tenant, listener)

    def cancel(self, task_ids: Sequence[int]) -> None:
        self.backend.cancel(task_ids)

    # -- replication hooks ------------------------------------------------------

    def plan_of(self, task_id: int) -> TransferPlan:
        return self.backend.plan_of(task_id)

    def drain_moves(self) -> list[TierMove]:
        # A one-stage group has no follower to replay tier moves: whichever
        # tenant drains them drops them.
        return self.backend.drain_moves()

    def publish(self, task_id: int) -> None:
        self.backend.publish(task_id)

    def discard(self, task_id: int) -> None:
        self.backend.discard(task_id)

    @property
    def fetch_in_match(self) -> bool:
        """The shared backend's (its leaders all prefetch outside their decisions)."""
        return self.backend.fetch_in_match

    @fetch_in_match.setter
    def fetch_in_match(self, value: bool) -> None:
        self.backend.fetch_in_match = value

    def prefetch(self, token_ids: TokenArray, token_mask: BoolMask | None = None,
                 namespace: str | None = None) -> None:
        if self.entry.content_epoch == self._owner.key_epoch():
            self.backend.prefetch(token_ids, token_mask, namespace)

    def refetch_failed(self, task_id: int) -> None:
        self.backend.refetch_failed(task_id)

    def tier_handle(self) -> dict[str, Any] | None:
        return self.backend.tier_handle()

    def claim_rows(self, task_id: int, lease: float) -> list[int] | None:
        return self.backend.claim_rows(task_id, lease, tenant=self.tenant)

    def claim_fence(self, task_id: int) -> int | None:
        return self.backend.claim_fence(task_id)

    def end_claim(self, task_id: int, committed: bool = True) -> bool:
        return self.backend.end_claim(task_id, committed)

    def peek(self, token_ids: TokenArray) -> dict[str, int] | None:
        """The shared index's read-only answer; nothing while the cache epoch moved
        and the shared backend is not flushed yet (its blocks are the old epoch's)."""
        if self.entry.content_epoch != self._owner.key_epoch():
            return {"cpu": 0, "ssd": 0}
        return self.backend.peek(token_ids)

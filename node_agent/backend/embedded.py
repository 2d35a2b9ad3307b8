"""The embedded KV cache backend: FlexKV's manager contract over this project's own tiers.

:class:`EmbeddedBackend` implements :class:`~.base.KVBackend` and, for PP leaders,
:class:`~.replication.ReplicatedBackend`. It combines

* a :class:`~.hashing.BlockHasher` (block identity),
* a :class:`~.index.BlockIndex` (hash -> tier block, LRU leaf-first eviction),
* a :class:`~.stage_store.TierStore` (CPU pool, SSD files, engine buffers, copies),
* a bounded task table and a pool of worker threads running the copies.

One lock guards the index and the task table; copies run outside it on the
workers. Tier moves (spills to SSD) are executed synchronously inside the
``put_match`` that decides them, before the index records them and before the
freed block can be handed to any plan, and on a leader are also queued for
:meth:`drain_moves`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from node_agent.backend.base import (
    BackendStats,
    BoolMask,
    KVBackendError,
    KVResponse,
    KVResponseStatus,
    MatchOp,
    SlotArray,
    TaskNotFoundError,
    TierStats,
    TokenArray,
)
from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.hashing import BlockHasher
from node_agent.backend.index import NO_NODES, BlockIndex, NodeIds
from node_agent.backend.inputs import mask_span, span_mask
from node_agent.backend.planes import RegisteredBuffers, register_buffers
from node_agent.backend.remote.keys import block_digest
from node_agent.backend.remote.tier import RemoteTier
from node_agent.backend.replication import ReplicatedBackend
from node_agent.backend.slots import launch_slots
from node_agent.backend.ssd_format import DROP_REASONS
from node_agent.backend.ssd_recovery import Recovery, RecoveryStopped
from node_agent.backend.ssd_tier import SsdTier
from node_agent.backend.stage_store import TierStore
from node_agent.backend.tasks import Task, TaskState
from node_agent.backend.transfer import CopyAborted
from node_agent.metrics import AgentMetrics
from node_agent.vocab.placement import BlockLocation, Direction, Tier, TierMove, TransferPlan
from node_agent.vocab.tokens import int64_array

if TYPE_CHECKING:
    from node_agent.events import StageEvents

log = logging.getLogger(__name__)

#: How long ``reset`` waits for the copies it aborted to stop. A copy checks its
#: abort flag before every run / plane copy, so it stops within milliseconds; only
#: a hung device exceeds this, and ``reset`` then raises instead of clearing.
STOP_SECONDS = 10.0


class EmbeddedBackend(ReplicatedBackend):
    """A complete KV cache manager for one PP stage, without FlexKV.

    With ``config.deferred_visibility`` (PP leaders) a put that finishes SUCCESS
    stays invisible until :meth:`publish`, and every tier move is queued for
    :meth:`drain_moves`; without it (single stage) a SUCCESS put is visible at
    once and moves are not queued.
    """

    def __init__(
        self,
        config: EmbeddedBackendConfig,
        metrics: AgentMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        remote: RemoteTier | None = None,
        cache_epoch: Callable[[], int] | None = None,
        events: StageEvents | None = None,
    ) -> None:
        self.config = config
        self.events = events
        """Where block stored / moved / cleared events go (None: KV events off)."""
        self._event_tokens: dict[int, list[TokenArray]] = {}
        """Unpublished put -> its members' tokens, in ``_unpublished`` order (events on)."""
        self.remote = remote
        self._cache_epoch = cache_epoch or (lambda: config.cache_epoch)
        """The current ``cacheEpoch``: a flush (``reset``) names it in a persistent SSD
        tier's files."""
        self.recovered_blocks = 0
        """SSD blocks recovered at start (a persistent SSD tier)."""
        self.recovered_dropped: dict[str, int] = {}
        """SSD blocks found at start and not recovered, by reason."""
        self.spilled_on_stop = 0
        """CPU blocks spilled to a persistent SSD tier by ``shutdown``."""
        self.recovery_done = threading.Event()
        """Set once a persistent SSD tier's recovery ended (at once without one)."""
        self.recovery: Recovery | None = None
        """What the recovery verified (bytes, seconds), once it was applied."""
        self._recovery: threading.Thread | None = None
        self._evicted: dict[int, int] = {}  # CPU block -> remote block digest (evict policy)
        # Node -> (its generation, the REMOTE -> CPU move) of blocks a fetch brought,
        # for refetch_failed (deferred visibility only).
        self._fetched: dict[int, tuple[int, TierMove]] = {}
        self._refetch: dict[int, tuple[int, TierMove]] = {}  # marked by refetch_failed
        # Node -> (its generation, the writer of the object a fetch brought): the
        # writer rule follows a fetched block to whichever tier it moves.
        self._node_writers: dict[int, tuple[int, int]] = {}
        self.tokens_per_block = config.tokens_per_block
        self._metrics = metrics
        self._gauges_set: tuple[tuple[int, int], ...] | None = None
        """Tier gauge values last set (``_update_gauges`` skips unchanged ones)."""
        self._spill_failures_counted = 0
        """The index's spill failures already added to ``flexkv_agent_ssd_errors_total``."""
        self._clock = clock
        self._hasher = BlockHasher(config.tokens_per_block, config.hash_algorithm)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._tasks: dict[int, Task] = {}
        self._members: dict[int, Task] = {}
        self._unpublished: dict[int, list[NodeIds]] = {}
        self._unpublished_by: dict[int, int] = {}  # put (or batch) id -> its tenant
        self._unlaunched: deque[Task] = deque()
        self._claimed: deque[Task] = deque()
        """Gets an engine copies itself (:meth:`claim_rows`), oldest claim first."""
        self._moves: list[TierMove] = []
        self._pending_buffers: dict[tuple[int, int], RegisteredBuffers] = {}
        """(tenant, rank) -> buffers registered before ``start``."""
        self._hits = {Tier.CPU: 0, Tier.SSD: 0}
        self._lookup_tokens = 0
        self._remote_hits = 0
        self._store: TierStore | None = None
        self._index: BlockIndex | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._reaper: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False
        self._listeners: dict[int, Callable[[], None]] = {}
        self._children: dict[tuple[object, ...], Any] = {}
        """Labelled metric children by (metric, label values) (:meth:`_child`)."""
        # Several stages on these tiers (node_agent.backend.shared): tenant -> the
        # replica it serves, and per tenant its lookups, hits and hits on blocks
        # another replica stored.
        self._tenant_names: dict[int, str] = {}
        self._tenant_lookup: dict[int, int] = {}
        self._tenant_hits: dict[int, dict[Tier, int]] = {}
        self._tenant_cross: dict[int, int] = {}
        self._owners: dict[int, tuple[int, str]] = {}
        """Node -> (its generation, the replica whose put created it), with tenants."""

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise KVBackendError("the backend was shut down; create a new one to start again")
            if self._store is not None:
                return
            store = TierStore(self.config, self.remote)
            for (tenant, _), reg in self._pending_buffers.items():
                store.add_registered(reg, tenant)
            self._pending_buffers.clear()
            self._store = store
            self._index = BlockIndex(
                store.num_blocks(Tier.CPU), store.num_blocks(Tier.SSD),
                self.config.high_watermark, self.config.low_watermark,
                mover=lambda move: store.apply_moves([move]),
                hash_bits=self._hasher.bits,
            )
            if self.remote is not None and self.remote.write_policy == "evict":
                self._index.on_cpu_evict = self._on_cpu_evict
            if self.events is not None:
                events = self.events
                self._index.on_move = lambda h, src, dst: events.moved(
                    h, src.value, None if dst is None else dst.value)
            if store.ssd is not None and store.ssd.persistent:
                self._restore_locked(store)
            else:
                self.recovery_done.set()
            self._pool = ThreadPoolExecutor(self.config.worker_threads,
                                            thread_name_prefix="flexkv-transfer")
            self._reaper = threading.Thread(target=self._reap_loop, name="flexkv-expiry",
                                            daemon=True)
            self._reaper.start()
            self._update_gauges()
        log.info("Embedded backend started", extra={
            "cpu_blocks": store.num_blocks(Tier.CPU), "ssd_blocks": store.num_blocks(Tier.SSD),
            "bytes_per_block": self.config.layout.bytes_per_block,
        })

    def _restore_locked(self, store: TierStore) -> None:
        """Start recovering what the persistent SSD tier found: its recorded blocks are
        reserved (never written) while a thread verifies them; the verified ones are
        then indexed (:meth:`BlockIndex.adopt`). Every later spill is recorded."""
        index, ssd = self._index, store.ssd
        assert index is not None and ssd is not None

        def record(block_hash: int, parent: int | None, block: int) -> None:
            try:
                ssd.record(block, block_hash, parent)
            except OSError as e:  # the block is cached; only its restart survival is lost
                log.error("SSD block record write failed", extra={"block": block,
                                                                  "error": str(e)})
                if self._metrics is not None:
                    self._metrics.ssd_errors.labels(op="record").inc()

        index.on_spill = record
        if self._metrics is not None:
            self._metrics.recovered_blocks.inc(0)
            for reason in DROP_REASONS:
                self._metrics.recovered_dropped_blocks.labels(reason=reason)
        if self._epoch_moved(ssd):  # a flush ran while this stage was being built
            ssd.reset_records(self._cache_epoch())
        if not ssd.recorded:
            self.recovery_done.set()
            return
        reserved = list(ssd.recorded)
        index.reserve_ssd(reserved)
        epoch = index.epoch
        self._recovery = threading.Thread(target=self._recover, args=(ssd, reserved, epoch),
                                          name="flexkv-ssd-recovery", daemon=True)
        self._recovery.start()

    def _epoch_moved(self, ssd: SsdTier) -> bool:
        """Whether the live cache epoch differs from the one the SSD tier's files
        were opened under (their blocks then belong to a flushed cache)."""
        return ssd.identity is not None and ssd.identity.cache_epoch != self._cache_epoch()

    def _recover(self, ssd: SsdTier, reserved: list[int], epoch: int) -> None:
        """Recovery thread: verify the recorded blocks, then index the good ones."""
        try:
            try:
                found = ssd.verify(stop=lambda: self._closed or self._index is None
                                   or self._index.epoch != epoch)
            except RecoveryStopped:
                log.info("SSD recovery stopped before it finished (shutdown or flush)")
                return
            except Exception:
                log.exception("SSD recovery failed; the recorded blocks are freed")
                found = Recovery()
            with self._cond:
                index = self._index
                if self._closed or index is None or index.epoch != epoch:
                    return  # a flush cleared the index (its SSD ring is whole again)
                if self._epoch_moved(ssd):
                    # The cache epoch moved without this backend's reset (yet): nothing
                    # written under the old one is adopted; the reset that follows
                    # frees the reserved blocks.
                    log.info("SSD recovery abandoned: the cache epoch moved")
                    return
                adopted = index.adopt([(r.hash, r.parent, r.block, r.seq)
                                       for r in found.blocks], reserved)
                dropped = dict(found.dropped)
                dropped["orphan"] += len(found.blocks) - adopted  # refused by the index
                self.recovered_blocks, self.recovered_dropped = adopted, dropped
                self.recovery = found
                if self._metrics is not None:
                    self._metrics.recovered_blocks.inc(adopted)
                    for reason, n in dropped.items():
                        self._metrics.recovered_dropped_blocks.labels(reason=reason).inc(n)
                self._update_gauges()
            log.info("SSD blocks recovered", extra={
                "blocks": adopted, "dropped": dropped, "bytes_verified": found.bytes_verified,
                "seconds": round(found.seconds, 3)})
        finally:
            self.recovery_done.set()

    def _spill_cpu_locked(self) -> None:
        """On shutdown with a persistent SSD tier: spill the CPU tier's blocks to SSD
        (leaf-first, least recently used first) within ``stop_spill_seconds``."""
        index, store = self._index, self._store
        if index is None or store is None or store.ssd is None or not store.ssd.persistent:
            return
        deadline = time.monotonic() + self.config.stop_spill_seconds
        index.on_cpu_evict = None  # the remote tier is closing: nothing more to offer it
        before = index.evictions[Tier.CPU]
        spilled, dropped = index.empty_cpu(lambda: time.monotonic() < deadline)
        self.spilled_on_stop = spilled
        self._count_spill_failures_locked()
        log.info("CPU tier spilled to SSD on stop", extra={
            "spilled": spilled, "dropped": dropped, "left": index.used(Tier.CPU),
            "evictions": index.evictions[Tier.CPU] - before})

    def is_ready(self) -> bool:
        return self.is_ready_for(0)

    def is_ready_for(self, tenant: int) -> bool:
        """:meth:`is_ready` for the engine ranks of ``tenant``."""
        store = self._store
        return store is not None and not self._closed and store.is_complete(tenant)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stopping.set()
            self._cancel_unlaunched_locked()
            self._abort_running_locked()
            pool, store = self._pool, self._store
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._cond:
            for t in self._tasks.values():
                if t.status is None:
                    self._finish_locked(t, KVResponseStatus.CANCELLED, "backend shut down")
            self._cond.notify_all()
        if self._recovery is not None:  # it checks _closed before every block
            self._recovery.join()
        with self._cond:
            self._spill_cpu_locked()
            if self.events is not None:  # the stage's blocks leave with it
                self.events.cleared()
                self.events.close()
        if store is not None:
            store.close()
        log.info("Embedded backend shut down")

    def reset(self) -> None:
        """See :meth:`KVBackend.reset`. Running copies are aborted and waited for (up
        to ``STOP_SECONDS``; they stop within one run / plane copy) before the index
        is cleared, so no copy writes a block after ``reset`` returns. Raises
        ``KVBackendError`` (nothing cleared) when a copy does not stop in time."""
        deadline = time.monotonic() + STOP_SECONDS
        while True:
            with self._cond:
                self._require_started()
                self._cancel_unlaunched_locked()
                running = self._abort_running_locked()
                if not running:
                    self._clear_locked()
                    break
            futures = [t.future for t in running if t.future is not None]
            _, late = futures_wait(futures, max(0.0, deadline - time.monotonic()))
            if late:
                ids = [t.id for t in running if t.future in late]
                raise KVBackendError(
                    f"reset: copies of tasks {ids[:5]} did not stop within {STOP_SECONDS} s "
                    "of their abort (hung device?); nothing was cleared; retry reset"
                )
        log.info("Embedded backend reset: every cached block dropped")

    def _clear_locked(self) -> None:
        """Cancel every unfinished task and forget every block (no copy is running)."""
        for t in self._tasks.values():
            if t.status is None:
                self._finish_locked(t, KVResponseStatus.CANCELLED, "cache reset")
        index = self._require_started()
        index.clear()
        assert self._store is not None
        if self._store.ssd is not None:
            self._store.ssd.reset_records(self._cache_epoch())
        self._fetched.clear()
        self._refetch.clear()
        self._node_writers.clear()
        self._unpublished.clear()
        self._unpublished_by.clear()
        self._owners.clear()
        self._event_tokens.clear()
        self._members.clear()
        self._moves.clear()
        self._store.reset()
        if self.events is not None:
            self.events.cleared()
        self._update_gauges()
        self._cond.notify_all()

    # -- registration ----------------------------------------------------------

    def register_kv_buffers(self, rank: int, buffers: Sequence[Sequence[torch.Tensor]]) -> None:
        self.register_for(0, rank, buffers)

    def register_for(self, tenant: int, rank: int,
                     buffers: Sequence[Sequence[torch.Tensor]]) -> None:
        """:meth:`register_kv_buffers` for the engine ranks of ``tenant`` (a stage
        sharing this backend, :mod:`node_agent.backend.shared`; 0: its own); only
        that tenant's copies in flight refuse a re-registration, and a tenant that
        left (:meth:`remove_tenant`) is refused."""
        reg = register_buffers(self.config.layout, rank, buffers)
        with self._lock:
            if self._departed_locked(tenant):
                raise KVBackendError(
                    f"tenant {tenant} left this shared backend (its stage closed); register "
                    "the rank with the stage that serves the replica now"
                )
            busy = [t.id for t in self._tasks.values() if t.state is TaskState.LAUNCHED
                    and t.status is None and t.tenant == tenant]
            if busy:
                raise KVBackendError(
                    f"rank {rank} re-registered while tasks {busy[:5]} are copying; wait for "
                    "them before re-registering"
                )
            if self._store is None:
                self._pending_buffers[(tenant, rank)] = reg
            else:
                self._store.add_registered(reg, tenant)
        log.info("Engine rank registered KV buffers",
                 extra={"rank": rank, "slots": reg.num_slots, "device": str(reg.device)})

    # -- matching ------------------------------------------------------------

    def _namespace(self, namespace: str | None) -> str | None:
        """The hash namespace of a call: the stage's model namespace, joined with
        the call's own (a LoRA name, a cache salt) when it names one."""
        stage = self.config.namespace
        if stage is None or namespace is None:
            return stage if namespace is None else namespace
        return f"{stage}\x00{namespace}"

    def _block_hashes(self, token_ids: object, token_mask: object,
                      namespace: str | None) -> tuple[TokenArray, int, int, list[int]]:
        """The inputs of a match, checked: ``(tokens, start, end, hashes)``, where
        ``[start, end)`` is the span the mask selects and ``hashes`` are the chained
        hashes of the whole blocks up to ``end``. ``ValueError`` names a bad input."""
        tokens = int64_array("token_ids", token_ids)
        start, end = mask_span(token_mask, len(tokens), self.tokens_per_block)
        hashes = self._hasher.hashes(tokens, self._namespace(namespace),
                                     limit=end // self.tokens_per_block)
        return tokens, start, end, hashes

    def _match(self, op: MatchOp, tokens: TokenArray, token_mask: BoolMask | None,
               namespace: str | None) -> tuple[int, BoolMask]:
        return self.match_for(0, op, tokens, token_mask, namespace)

    def match_for(self, tenant: int, op: MatchOp, tokens: TokenArray,
                  token_mask: BoolMask | None, namespace: str | None) -> tuple[int, BoolMask]:
        """``get_match`` / ``put_match`` of checked ``tokens`` for ``tenant``: the
        task copies from / to that tenant's engine buffers and only it launches it."""
        if op == "get":
            return self._get_match(tokens, token_mask, namespace, tenant)
        return self._put_match(tokens, token_mask, namespace, tenant)

    def add_tenant(self, tenant: int, replica: str) -> None:
        """``tenant`` (a stage sharing this backend) joins, named ``replica``: its calls
        are served until :meth:`remove_tenant`, and its lookups and hits are counted
        apart (its hits on blocks another replica stored are cross-replica hits)."""
        with self._lock:
            self._tenant_names[tenant] = replica
            self._tenant_lookup[tenant] = 0
            self._tenant_hits[tenant] = {Tier.CPU: 0, Tier.SSD: 0}
            self._tenant_cross[tenant] = 0

    def _get_match(self, token_ids: TokenArray, token_mask: BoolMask | None,
                   namespace: str | None, tenant: int = 0) -> tuple[int, BoolMask]:
        t0 = time.perf_counter()
        tokens, start, end, hashes = self._block_hashes(token_ids, token_mask, namespace)
        tpb = self.tokens_per_block
        if self.remote is not None and hashes and self.fetch_in_match:
            self._continue_on_remote(hashes)
        with self._lock:
            index = self._require_started()
            self._expire_locked()
            if self._departed_locked(tenant):
                self._observe_match("get", t0)
                return -1, span_mask(len(tokens), 0, 0)
            nodes = index.match(hashes, index.keys(hashes))
            first, last = start // tpb, min(len(nodes), end // tpb)
            self._lookup_tokens += max(0, end - start)
            if tenant in self._tenant_lookup:
                self._tenant_lookup[tenant] += max(0, end - start)
            if self._metrics is not None:
                self._metrics.lookup_tokens.inc(max(0, end - start))
            if last <= first:
                self._observe_match("get", t0)
                return -1, span_mask(len(tokens), 0, 0)
            self._check_capacity_locked()
            span = nodes[first:last]
            if self._refetch:
                self._queue_refetches_locked(span)
            index.touch(nodes[:last])
            index.lock(span)
            locs = index.locations(span)
            on_ssd = index.ssd_blocks(span)
            self._hits[Tier.SSD] += on_ssd
            self._hits[Tier.CPU] += len(locs) - on_ssd
            if tenant in self._tenant_hits:
                self._count_tenant_hits_locked(tenant, span, on_ssd)
            if self._metrics is not None:
                if on_ssd:
                    self._child(self._metrics.hit_tokens, tier="ssd").inc(on_ssd * tpb)
                if len(locs) - on_ssd:
                    self._child(self._metrics.hit_tokens, tier="cpu").inc(
                        (len(locs) - on_ssd) * tpb)
            task = self._new_task_locked(
                Direction.LOAD, span_mask(len(tokens), first * tpb, last * tpb), span,
                TransferPlan(Direction.LOAD, locs), tenant,
            )
        self._observe_match("get", t0)
        assert task.mask is not None
        return task.id, task.mask

    def _put_match(self, token_ids: TokenArray, token_mask: BoolMask | None,
                   namespace: str | None, tenant: int = 0) -> tuple[int, BoolMask]:
        t0 = time.perf_counter()
        tokens, start, end, hashes = self._block_hashes(token_ids, token_mask, namespace)
        tpb = self.tokens_per_block
        nothing = (-1, span_mask(len(tokens), 0, 0))
        with self._lock:
            index = self._require_started()
            self._expire_locked()
            if self._departed_locked(tenant):
                self._observe_match("put", t0)
                return nothing
            keys = index.keys(hashes)
            prefix = index.match(hashes, keys)
            first, last = max(len(prefix), start // tpb), end // tpb
            index.touch(prefix[:first])
            if first >= last or len(prefix) < start // tpb or index.contains(hashes[first]):
                # Nothing new; or the prefix before the caller's span is not cached
                # (a block without its parent would be unreachable); or another
                # put is storing the next block right now.
                self._observe_match("put", t0)
                return nothing
            self._check_capacity_locked()
            moves: list[TierMove] = []
            parent = int(prefix[first - 1]) if first else None
            created = index.add_pending(parent, hashes[first:last], moves, keys[first:last])
            index.enforce_watermarks(moves)
            self._record_moves_locked(moves)
            if not len(created):
                log.warning("CPU tier has no evictable block; put skipped",
                            extra={"cpu_blocks": index.capacity[Tier.CPU],
                                   "blocks_wanted": last - first})
                self._observe_match("put", t0)
                return nothing
            task = self._new_task_locked(
                Direction.STORE,
                span_mask(len(tokens), first * tpb, (first + len(created)) * tpb),
                created,
                TransferPlan(Direction.STORE, index.locations(created)), tenant,
            )
            name = self._tenant_names.get(tenant)
            if name is not None:
                for node in created.tolist():
                    self._owners[node] = (index.generation(node), name)
            if self.events is not None:
                task.tokens = tokens[first * tpb:(first + len(created)) * tpb]
        self._observe_match("put", t0)
        assert task.mask is not None
        return task.id, task.mask

    def peek(self, token_ids: TokenArray) -> dict[str, int] | None:
        """See :meth:`ReplicatedBackend.peek`. The index is read without the backend
        lock and nothing is written: a store, eviction or flush running meanwhile
        may or may not show in the answer (its arrays keep their size, so a read
        racing them stays in bounds)."""
        tokens = int64_array("token_ids", token_ids)
        hashes = self._hasher.hashes(tokens, self._namespace(None))
        index = self._require_started()
        nodes = index.match(hashes)
        on_ssd = index.ssd_blocks(nodes)
        tpb = self.tokens_per_block
        return {"cpu": (len(nodes) - on_ssd) * tpb, "ssd": on_ssd * tpb}

    # -- remote tier -----------------------------------------------------------

    def prefetch(self, token_ids: TokenArray, token_mask: BoolMask | None = None,
                 namespace: str | None = None) -> None:
        """See :meth:`ReplicatedBackend.prefetch`: the remote continuation of
        :meth:`get_match` on its own (the backend lock is held only to reserve and
        to publish, never during the fetch)."""
        if self.remote is None:
            return
        hashes = self._block_hashes(token_ids, token_mask, namespace)[3]
        if hashes:
            self._continue_on_remote(hashes)

    def _continue_on_remote(self, hashes: list[int]) -> None:
        """Extend the locally cached prefix of ``hashes`` from the remote tier.

        :meth:`RemoteTier.lookup` of the blocks after the local prefix; the blocks
        found (a run from the first) are reserved as pending CPU blocks, fetched
        outside the lock, and the contiguous run that arrived whole is published
        (with deferred visibility, as REMOTE -> CPU moves for the followers, queued
        before any plan that loads them); the rest is removed. The whole
        continuation is bounded by ``timeoutSeconds``; any failure is a shorter hit."""
        remote = self.remote
        assert remote is not None
        deadline = time.monotonic() + remote.settings.timeout_seconds
        with self._lock:
            index = self._require_started()
            keys = index.keys(hashes)
            have = len(index.match(hashes, keys))
            if have >= len(hashes) or index.contains(hashes[have]):
                return  # fully cached, or another put / fetch is filling the next block
        ids = [block_digest(h) for h in hashes[have:]]
        found = remote.lookup(ids, deadline - time.monotonic())
        if not found:
            return
        with self._lock:
            index = self._require_started()
            epoch = index.epoch
            prefix = index.match(hashes[: have + 1], keys[: have + 1])
            if len(prefix) != have or index.contains(hashes[have]):
                return  # the index changed meanwhile; match what is there
            self._check_capacity_locked()
            moves: list[TierMove] = []
            parent = int(prefix[have - 1]) if have else None
            created = index.add_pending(parent, hashes[have:have + found], moves,
                                        keys[have:have + found])
            self._record_moves_locked(moves)
            if not len(created):
                return
            locs = index.locations(created)
            resets = remote.resets  # a reset from now on frees the reserved blocks
            # A prefix comes from one writer: a continuation of blocks an earlier
            # fetch brought (on any tier now) takes only that writer's objects.
            writer = self._writer_locked(int(prefix[have - 1])) if have else None
        got = 0
        try:
            got = remote.fetch(ids[: len(created)], [loc.index for loc in locs],
                               deadline - time.monotonic(), self.remote_fetch_hook, resets,
                               writer)
        finally:
            fetched = [TierMove(BlockLocation(Tier.REMOTE, b), loc)
                       for b, loc in zip(ids[:got], locs[:got], strict=False)]
            run_writer = remote.writer_of(locs[0].index) if got else None
            with self._lock:
                index = self._require_started()
                if index.epoch == epoch:
                    index.remove_pending(created[got:])
                    if got:
                        index.publish(created[:got])
                        if run_writer is not None:
                            for node in created[:got].tolist():
                                self._node_writers[node] = (index.generation(node), run_writer)
                        if self.config.deferred_visibility:
                            self._moves.extend(fetched)
                            for node, move in zip(created[:got].tolist(), fetched, strict=True):
                                self._fetched[node] = (index.generation(node), move)
                    self._update_gauges()
        if got:
            self._remote_hits += got

    #: Tests: called between fetch chunks with the blocks fetched so far.
    remote_fetch_hook: Callable[[int], None] | None = None

    def refetch_failed(self, task_id: int) -> None:
        """See :meth:`ReplicatedBackend.refetch_failed`: each block of the load task
        that a fetch brought (and that still holds those bytes on the CPU tier) is
        marked for a new fetch. The next match that loads it, when no other task
        holds it, queues its REMOTE -> CPU move again before its plan: each
        follower fetches its own object into the same CPU block once more (one
        whose fetch failed retries; one whose fetch worked rewrites the same
        block). The leader's own copies passed their checks and stay."""
        with self._lock:
            t = self._tasks.get(task_id)
            index = self._index
            if t is None or index is None or t.is_put or t.epoch != index.epoch:
                return
            marked = 0
            for node in t.nodes.tolist():
                entry = self._fetched.get(node)
                if entry is not None and self._still_fetched_locked(node, entry):
                    self._refetch[node] = entry
                    marked += 1
            if marked:
                log.info("Remote blocks marked for a new fetch on every stage",
                         extra={"task_id": task_id, "blocks": marked})

    def _writer_locked(self, node: int) -> int | None:
        """The writer of the object a fetch brought into ``node`` (wherever the block
        is now); None for bytes this stage wrote itself."""
        assert self._index is not None
        entry = self._node_writers.get(node)
        return entry[1] if entry is not None and entry[0] == self._index.generation(node) \
            else None

    def _still_fetched_locked(self, node: int, entry: tuple[int, TierMove]) -> bool:
        """Whether ``node`` is still the block a fetch brought to ``entry``'s CPU block."""
        assert self._index is not None
        return (entry[0] == self._index.generation(node)
                and self._index.location(node) == entry[1].dst)

    def _queue_refetches_locked(self, span: NodeIds) -> None:
        """Before ``span`` is locked for a load: queue the REMOTE -> CPU moves of its
        blocks marked by :meth:`refetch_failed` that no other task holds."""
        assert self._index is not None
        nodes = span.tolist()
        locks = self._index.lock_counts(span).tolist()
        for node, held in zip(nodes, locks, strict=True):
            entry = self._refetch.get(node)
            if entry is None:
                continue
            if not self._still_fetched_locked(node, entry):
                del self._refetch[node]
            elif not held:
                del self._refetch[node]
                self._moves.append(entry[1])

    def _announce_locked(self, nodes: NodeIds, tokens: TokenArray) -> None:
        """Tell the events that ``nodes`` (one chain run, just visible) are stored."""
        index, events = self._index, self.events
        if events is None or index is None or not len(nodes):
            return
        events.stored(index.node_hashes(nodes), index.parent_hash(int(nodes[0])), tokens)

    def _on_cpu_evict(self, block_hash: int, cpu_block: int) -> None:
        """Index callback (under the lock): a visible block leaves the CPU tier."""
        self._evicted[cpu_block] = block_digest(block_hash)

    def _remote_write_locked(self, nodes: NodeIds) -> None:
        """A put became visible: with ``writePolicy: store`` write its blocks to the
        remote tier (and tell followers to write theirs: CPU -> REMOTE moves)."""
        remote, index = self.remote, self._index
        if remote is None or index is None or remote.write_policy != "store" or not len(nodes):
            return
        ids = [block_digest(h) for h in index.node_hashes(nodes)]
        cpu = [loc.index for loc in index.locations(nodes)]
        remote.offer(ids, cpu)
        if self.config.deferred_visibility:
            self._moves.extend(TierMove(BlockLocation(Tier.CPU, c), BlockLocation(Tier.REMOTE, b))
                               for b, c in zip(ids, cpu, strict=True))

    # -- execution -----------------------------------------------------------

    def _launch(self, ids: list[int], slot_mappings: Sequence[SlotArray],
                as_batch: bool) -> list[int]:
        return self.launch_for(0, ids, slot_mappings, as_batch)

    def launch_for(self, tenant: int, ids: list[int], slot_mappings: Sequence[SlotArray],
                   as_batch: bool) -> list[int]:
        """``launch`` of checked task ``ids`` of ``tenant``, with slots of that
        tenant's engine buffers; a task another tenant matched is refused."""
        with self._lock:
            self._require_started()
            self._expire_locked()
            store = self._store
            assert store is not None
            if self._departed_locked(tenant):
                raise KVBackendError(
                    f"tenant {tenant} left this shared backend (its stage closed) and its "
                    "tasks ended with it; launch from the stage that serves the replica now"
                )
            if not store.is_complete(tenant):
                raise KVBackendError(
                    f"engine ranks {self._missing_ranks(tenant)} have not registered KV "
                    "buffers; launch after every expected rank registered (is_ready())"
                )
            tasks = []
            for tid in ids:
                t = self._tasks.get(tid)
                if t is None or t.state is not TaskState.MATCHED or t.members \
                        or t.tenant != tenant:
                    raise TaskNotFoundError(
                        f"task {tid} is not a live, un-launched match (unknown, expired, "
                        "cancelled or already launched); match again"
                    )
                tasks.append(t)
            num_slots = store.num_slots(tenant)
            slots = []
            for t, mapping in zip(tasks, slot_mappings, strict=True):
                assert t.mask is not None
                slots.append(launch_slots(
                    mapping, int(t.mask.sum()), num_slots, f"slot mapping of task {t.id}"
                ))
            if len(slots) > 1:
                allslots = torch.cat(slots).numpy()
                uniq, counts = np.unique(allslots, return_counts=True)
                if len(uniq) != len(allslots):
                    raise ValueError(
                        f"slot {int(uniq[counts > 1][0])} appears in several slot mappings "
                        f"of one launch (tasks {ids}); each token needs its own slot"
                    )
            # Validated: nothing can fail from here on, so every task launches.
            out = ids
            if as_batch and len(tasks) > 1:
                batch = Task(next(self._ids), None, None, NO_NODES, None, deadline=0.0,
                             state=TaskState.LAUNCHED, members=tasks, tenant=tenant)
                for t in tasks:
                    del self._tasks[t.id]
                    self._members[t.id] = t
                    t.batch = batch
                self._tasks[batch.id] = batch
                out = [batch.id]
            pool = self._pool
            assert pool is not None
            for t, s in zip(tasks, slots, strict=True):
                t.state = TaskState.LAUNCHED
                t.future = pool.submit(self._run, t, s)
        return out

    def _wait(self, ids: list[int], timeout: float, completely: bool) -> dict[int, KVResponse]:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                self._expire_locked()
                live = [self._tasks[i] for i in ids if i in self._tasks]
                done = [t for t in live if t.status is not None]
                remaining = deadline - time.monotonic()
                if len(done) == len(live) or (done and not completely) or remaining <= 0:
                    break
                self._cond.wait(min(remaining, self._tick_seconds()))
            timed_out = time.monotonic() >= deadline
            out: dict[int, KVResponse] = {}
            for i in ids:
                t = self._tasks.get(i)
                if t is None:
                    out[i] = KVResponse(KVResponseStatus.NOTFOUND, i)
                elif t.status is None:
                    st = KVResponseStatus.TIMEOUT if timed_out else KVResponseStatus.UNREADY
                    out[i] = KVResponse(st, i, None)
                else:
                    out[i] = self._reap_locked(t)
            return out

    def set_completion_listener(self, listener: Callable[[], None] | None) -> None:
        """See :meth:`KVBackend.set_completion_listener`: called by the worker that
        finished a copy, after the task's terminal status is recorded."""
        self.set_listener_for(0, listener)

    def set_listener_for(self, tenant: int, listener: Callable[[], None] | None) -> None:
        """The completion listener of ``tenant``'s tasks (None removes it)."""
        with self._lock:
            if listener is None:
                self._listeners.pop(tenant, None)
            else:
                self._listeners[tenant] = listener

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, KVResponse]:
        out: dict[int, KVResponse] = {}
        with self._lock:
            self._expire_locked()
            for i in (int(t) for t in task_ids):
                t = self._tasks.get(i)
                if t is None:
                    out[i] = KVResponse(KVResponseStatus.NOTFOUND, i)
                elif t.status is not None:
                    out[i] = self._reap_locked(t)
        return out

    def cancel(self, task_ids: Sequence[int]) -> None:
        """See :meth:`KVBackend.cancel`: an un-launched task ends CANCELLED (and is
        forgotten) at once; a launched, unfinished task (or batch, or batch member)
        has its copy aborted and ends CANCELLED when the copy stopped."""
        with self._cond:
            for i in (int(t) for t in task_ids):
                self._cancel_locked(i, "cancelled")
            self._cond.notify_all()

    def _cancel_locked(self, task_id: int, reason: str, discard: bool = False) -> None:
        """End task ``task_id`` (under the lock; unknown or terminal: nothing). An
        un-launched match ends CANCELLED with ``reason`` and is forgotten at once; a
        launched, unfinished task (or batch, or member) has its copy aborted and,
        with ``discard``, its blocks freed when the copy ends."""
        t = self._tasks.get(task_id) or self._members.get(task_id)
        if t is None or t.status is not None:
            return
        if t.state is TaskState.MATCHED and not t.members:
            self._finish_locked(t, KVResponseStatus.CANCELLED, reason)
            del self._tasks[task_id]
            return
        if t.state is TaskState.CLAIMED:
            # The engine copies; its end_claim answers False from now on, so the
            # blocks are free to reuse at once.
            self._finish_locked(t, KVResponseStatus.CANCELLED, reason)
            return
        if discard:
            for m in t.members or [t]:
                m.discarded = True
        self._abort_locked(t)

    # -- engine-side loads --------------------------------------------------------

    def tier_handle(self) -> dict[str, Any] | None:
        store = self._store
        return None if store is None else store.cpu.handle()

    def claim_rows(self, task_id: int, lease: float, tenant: int = 0) -> list[int] | None:
        """See :meth:`ReplicatedBackend.claim_rows`; ``tenant``: the stage claiming
        (a task another tenant matched is refused like an unknown one)."""
        with self._lock:
            self._expire_locked()
            store = self._store
            t = self._tasks.get(task_id)
            if t is None or t.state is not TaskState.MATCHED or t.members or t.is_put \
                    or t.tenant != tenant or t.plan is None:
                raise TaskNotFoundError(
                    f"task {task_id} is not a live, un-launched get (unknown, expired, "
                    "cancelled, a put or already launched or claimed); match again"
                )
            if store is None or store.cpu.tier_id is None \
                    or any(b.tier is not Tier.CPU for b in t.plan.blocks):
                return None
            try:
                store.check_plan(t.plan)
            except ValueError:
                return None  # launching it reports why
            t.state = TaskState.CLAIMED
            t.deadline = self._clock() + lease
            t.fence = store.cpu.fence_value()
            self._claimed.append(t)
            return [b.index for b in t.plan.blocks]

    def claim_fence(self, task_id: int) -> int | None:
        """See :meth:`ReplicatedBackend.claim_fence`."""
        with self._lock:
            t = self._tasks.get(task_id)
            if t is None or t.state is not TaskState.CLAIMED or t.status is not None:
                return None
            return t.fence

    def end_claim(self, task_id: int, committed: bool = True) -> bool:
        """See :meth:`ReplicatedBackend.end_claim`."""
        with self._cond:
            self._expire_locked()
            held = self._end_claim_locked(task_id, committed)
            self._cond.notify_all()
        if self._metrics is not None:
            outcome = "released" if not committed else "committed" if held else "ended"
            self._child(self._metrics.engine_loads, outcome=outcome).inc()
        return held

    def _end_claim_locked(self, task_id: int, committed: bool) -> bool:
        t = self._tasks.get(task_id)
        if t is None:
            return False
        if t.state is not TaskState.CLAIMED and t.status is None:
            raise TaskNotFoundError(
                f"task {task_id} was not claimed ({t.state.value}); end_claim only "
                "ends what claim_rows handed out"
            )
        # Not in the transfer metrics: those time the agent's own copies.
        held = t.state is TaskState.CLAIMED and t.status is None
        if held:
            self._finish_locked(t, KVResponseStatus.SUCCESS, None, committed=committed)
        self._reap_locked(t)
        return held

    # -- replication (PP leader) -------------------------------------------------

    def plan_of(self, task_id: int) -> TransferPlan:
        with self._lock:
            t = self._tasks.get(task_id) or self._members.get(task_id)
            if t is None:
                raise TaskNotFoundError(f"task {task_id} is unknown or reaped; it has no plan")
            if t.plan is None:
                raise KVBackendError(
                    f"task {task_id} is a batch of {[m.id for m in t.members]}; take the plans "
                    "of its members (plan_of each id before launching as_batch)"
                )
            return t.plan

    def drain_moves(self) -> list[TierMove]:
        with self._lock:
            moves, self._moves = self._moves, []
            return moves

    def publish(self, task_id: int) -> None:
        with self._lock:
            nodes = self._unpublished.pop(task_id, None)
            self._unpublished_by.pop(task_id, None)
            if nodes is None:
                t = self._tasks.get(task_id) or self._members.get(task_id)
                if t is not None and t.status is None:
                    raise KVBackendError(
                        f"task {task_id} has not finished; publish it after wait() answered "
                        "SUCCESS on every stage"
                    )
                raise TaskNotFoundError(
                    f"task {task_id} has no finished, unpublished put (unknown, a get, failed, "
                    "already published or discarded)"
                )
            index = self._require_started()
            done = np.concatenate(nodes)
            index.publish(done)
            tokens = self._event_tokens.pop(task_id, None)
            if tokens is not None:
                for run, toks in zip(nodes, tokens, strict=False):
                    self._announce_locked(run, toks)
            self._remote_write_locked(done)
            if self._metrics is not None:
                self._metrics.stored_tokens.inc(len(done) * self.tokens_per_block)

    def discard(self, task_id: int) -> None:
        """See :meth:`ReplicatedBackend.discard`. A put (or batch) still copying is
        marked discard-on-finish and its copy aborted: when it ends, its pending
        blocks are freed instead of waiting for publish; an un-launched one is
        cancelled."""
        with self._cond:
            nodes = self._unpublished.pop(task_id, None)
            self._unpublished_by.pop(task_id, None)
            self._event_tokens.pop(task_id, None)
            if nodes and self._index is not None:
                self._index.remove_pending(np.concatenate(nodes))
                self._update_gauges()
            self._cancel_locked(task_id, "discarded", discard=True)
            self._cond.notify_all()

    # -- tenants (stages sharing this backend) -------------------------------

    def _departed_locked(self, tenant: int) -> bool:
        """Whether ``tenant`` is a stage that left this backend (:meth:`remove_tenant`);
        0, the backend's own, never leaves."""
        return tenant != 0 and tenant not in self._tenant_names

    def _count_tenant_hits_locked(self, tenant: int, span: NodeIds, on_ssd: int) -> None:
        """Count ``tenant``'s hit blocks ``span`` (``on_ssd`` of them on the SSD tier)
        and, among them, those another replica's put created (cross-replica hits)."""
        assert self._index is not None
        hits = self._tenant_hits[tenant]
        hits[Tier.SSD] += on_ssd
        hits[Tier.CPU] += len(span) - on_ssd
        name = self._tenant_names[tenant]
        cross = 0
        for node in span.tolist():
            owner = self._owners.get(node)
            if owner is not None and owner[1] != name \
                    and owner[0] == self._index.generation(node):
                cross += 1
        if cross:
            self._tenant_cross[tenant] += cross
            if self._metrics is not None:
                self._metrics.replica_cross_hit_tokens.labels(replica=name).inc(
                    cross * self.tokens_per_block)

    def end_tenant_tasks(self, tenant: int, reason: str) -> None:
        """End every task of ``tenant`` and wait for its copies to stop (up to
        ``STOP_SECONDS``): un-launched matches end CANCELLED, running copies are
        aborted, puts (finished or not) are discarded, never published. Other
        tenants' tasks and every published block stay. Raises ``KVBackendError``
        when a copy does not stop in time (its task is still aborted and
        discarded when it ends)."""
        deadline = time.monotonic() + STOP_SECONDS
        with self._cond:
            if self._index is None:
                return
            for key in [k for k, t in self._unpublished_by.items() if t == tenant]:
                self._unpublished_by.pop(key, None)
                nodes = self._unpublished.pop(key, None)
                if nodes:
                    self._index.remove_pending(np.concatenate(nodes))
            mine = [t for t in [*self._tasks.values(), *self._members.values()]
                    if t.tenant == tenant and t.status is None]
            for t in mine:
                self._cancel_locked(t.id, reason, discard=True)
            running = [t.future for t in mine if t.future is not None and t.status is None]
            self._update_gauges()
            self._cond.notify_all()
        _, late = futures_wait(running, max(0.0, deadline - time.monotonic()))
        if late:
            raise KVBackendError(
                f"copies of {len(late)} tasks of an ending stage did not stop within "
                f"{STOP_SECONDS} s of their abort (hung device?); they are discarded when "
                "they end"
            )

    def remove_tenant(self, tenant: int) -> None:
        """``tenant``'s stage leaves: from now on its matches answer a miss /
        nothing stored and its launches and registrations are refused (an engine
        call of the stage still in flight cannot leave a task behind); then its
        tasks end (:meth:`end_tenant_tasks`), and its engine buffers and listener
        are forgotten. The blocks it stored stay cached for the other tenants."""
        with self._lock:
            for counts in (self._tenant_names, self._tenant_lookup, self._tenant_hits,
                           self._tenant_cross):
                counts.pop(tenant, None)
        try:
            self.end_tenant_tasks(tenant, "its stage left the shared backend")
        finally:
            with self._lock:
                self._listeners.pop(tenant, None)
                if self._store is not None:
                    self._store.drop_tenant(tenant)
                for key in [k for k in self._pending_buffers if k[0] == tenant]:
                    del self._pending_buffers[key]

    def stats_for(self, tenant: int) -> BackendStats:
        """:meth:`stats` as ``tenant`` sees them: the shared tiers' capacity and use,
        its own hit blocks, lookups and registered ranks."""
        base = self.stats()
        with self._lock:
            hits = self._tenant_hits.get(tenant, {})
            tiers = {name: dataclasses.replace(t, hit_blocks=hits.get(Tier(name), 0))
                     for name, t in base.tiers.items()}
            store = self._store
            ranks = store.ranks_of(tenant) if store else tuple(
                sorted(r for t, r in self._pending_buffers if t == tenant))
            return dataclasses.replace(base, tiers=tiers, registered_ranks=ranks,
                                       lookup_tokens=self._tenant_lookup.get(tenant, 0))

    def tenant_share(self, tenant: int) -> dict[str, int]:
        """``tenant``'s part of this backend: ``storedBlocks`` (blocks its puts
        created that are cached now) and ``crossHitBlocks`` (its hit blocks that
        another replica's put created)."""
        with self._lock:
            name, index = self._tenant_names.get(tenant), self._index
            stored = 0
            if name is not None and index is not None:
                stored = sum(1 for node, (gen, who) in self._owners.items()
                             if who == name and index.generation(node) == gen
                             and index.is_visible(node))
            return {"storedBlocks": stored,
                    "crossHitBlocks": self._tenant_cross.get(tenant, 0)}

    # -- stats ---------------------------------------------------------------

    def stats(self) -> BackendStats:
        with self._lock:
            index, store = self._index, self._store
            bpb = self.config.layout.bytes_per_block
            tiers = {}
            if index is not None:
                for tier in (Tier.CPU, Tier.SSD):
                    cap = index.capacity[tier]
                    if tier is Tier.SSD and not cap:
                        continue
                    used = index.used(tier)
                    tiers[tier.value] = TierStats(
                        capacity_bytes=cap * bpb, used_bytes=used * bpb, capacity_blocks=cap,
                        used_blocks=used, evictions=index.evictions[tier],
                        hit_blocks=self._hits[tier],
                        recovered_blocks=self.recovered_blocks if tier is Tier.SSD else 0,
                    )
            counts = {s.value: 0 for s in TaskState}
            for t in self._tasks.values():
                key = TaskState.DONE if t.status is not None else t.state
                counts[key.value] += 1
            counts["unpublished"] = len(self._unpublished)
            ranks = store.registered_ranks if store else tuple(
                sorted(r for t, r in self._pending_buffers if t == 0))
            return BackendStats(tiers=tiers, tasks=counts, registered_ranks=ranks,
                                expected_ranks=self.config.expected_ranks,
                                lookup_tokens=self._lookup_tokens)

    @property
    def store(self) -> TierStore:
        """The stage store underneath (tiers and engine buffers); after ``start``."""
        if self._store is None:
            raise KVBackendError("the backend has not started; call start() first")
        return self._store

    # -- internals -------------------------------------------------------------

    def _require_started(self) -> BlockIndex:
        if self._closed:
            raise KVBackendError("the backend was shut down")
        if self._index is None:
            raise KVBackendError("the backend has not started; call start() first")
        return self._index

    def _missing_ranks(self, tenant: int = 0) -> list[int]:
        store = self._store
        have = set(store.ranks_of(tenant)) if store else {
            r for t, r in self._pending_buffers if t == tenant}
        return sorted(set(range(self.config.expected_ranks)) - have)

    def _check_capacity_locked(self) -> None:
        live = len(self._tasks) + len(self._unpublished)
        if live >= self.config.max_tasks:
            raise KVBackendError(
                f"task table full: {live} live tasks and unpublished puts (max_tasks="
                f"{self.config.max_tasks}); wait for, cancel, publish or discard tasks, or "
                "raise max_tasks"
            )

    def _new_task_locked(
        self, direction: Direction, mask: BoolMask, nodes: NodeIds, plan: TransferPlan,
        tenant: int = 0,
    ) -> Task:
        assert self._index is not None
        task = Task(next(self._ids), direction, mask, nodes, plan,
                    deadline=self._clock() + self.config.unlaunched_match_seconds,
                    epoch=self._index.epoch, tenant=tenant)
        self._tasks[task.id] = task
        self._unlaunched.append(task)
        self._update_gauges()
        return task

    def _record_moves_locked(self, moves: list[TierMove]) -> None:
        """Record tier moves the index decided (spills were already copied by its mover).

        With ``writePolicy: evict`` a visible block leaving the CPU tier is first
        offered to the remote tier (a CPU -> REMOTE move before its spill or drop)."""
        self._count_spill_failures_locked()
        if self._evicted:
            evicted, self._evicted = self._evicted, {}
            assert self.remote is not None
            out: list[TierMove] = []
            for m in moves:
                b = evicted.get(m.src.index) if m.src.tier is Tier.CPU else None
                if b is not None:
                    self.remote.offer([b], [m.src.index])
                    out.append(TierMove(m.src, BlockLocation(Tier.REMOTE, b)))
                out.append(m)
            moves = out
        if not moves:
            return
        if self.config.deferred_visibility:
            self._moves.extend(moves)
        if self._metrics is not None:
            for m in moves:
                if m.dst is None or m.dst.tier is not Tier.REMOTE:
                    self._child(self._metrics.evictions, tier=m.src.tier.value).inc()

    def _run(self, task: Task, slots: torch.Tensor) -> None:
        """Worker: run one task's copy, then record its outcome.

        A task whose abort flag is set when the copy ends (checked under the lock
        that cancel / discard / reset set it under) finishes CANCELLED, even when
        the copy got past its last check: it is never published."""
        t0 = time.perf_counter()
        status, error = KVResponseStatus.SUCCESS, None
        try:
            assert self._store is not None and task.plan is not None
            if task.tenant:  # a stage sharing this backend: its own engine buffers
                self._store.copy(task.plan, slots, task.abort, tenant=task.tenant)
            else:
                self._store.copy(task.plan, slots, task.abort)
        except CopyAborted:
            pass  # the abort flag is set: recorded as CANCELLED below
        except Exception as e:
            status, error = KVResponseStatus.FAILED, f"{type(e).__name__}: {e}"
            log.exception("KV transfer failed", extra={"task_id": task.id})
        with self._cond:
            if task.abort.is_set() and status is KVResponseStatus.SUCCESS:
                status = KVResponseStatus.CANCELLED
                error = ("cancelled while copying; the blocks are not stored" if task.is_put
                         else "cancelled while copying; the slots hold undefined data")
            if task.status is None:
                self._finish_locked(task, status, error)
            self._cond.notify_all()
        listener = self._listeners.get(task.tenant)
        if listener is not None:
            try:
                listener()
            except Exception:  # a listener's failure must not lose the task's outcome
                log.exception("Completion listener failed", extra={"task_id": task.id})
        if self._metrics is not None and task.plan is not None:
            d = task.plan.direction.value
            self._child(self._metrics.transfer_seconds, direction=d).observe(
                time.perf_counter() - t0)
            if status is KVResponseStatus.SUCCESS:
                bpb = self.config.layout.bytes_per_block
                for tier in (Tier.CPU, Tier.SSD):
                    k = sum(1 for b in task.plan.blocks if b.tier is tier)
                    if k:
                        self._child(self._metrics.transfer_bytes, direction=d,
                                    tier=tier.value).inc(
                            k * bpb)

    def _finish_locked(self, task: Task, status: KVResponseStatus, error: str | None,
                       committed: bool = False) -> None:
        """Record a terminal status and release or publish the task's blocks.
        ``committed``: a claimed get ends by its engine's commit; a claimed get
        ending any other way moves the claim fence first, before its blocks unpin
        (:meth:`CpuTier.bump_fence`)."""
        if task.state is TaskState.CLAIMED and not committed and self._store is not None:
            self._store.cpu.bump_fence()
            if self._metrics is not None:
                self._metrics.claim_fence_moves.inc()
        task.status, task.error = status, error
        task.finished_at = self._clock()
        task.state = TaskState.DONE
        index = self._index
        if index is not None and len(task.nodes) and task.epoch == index.epoch:
            if not task.is_put:
                index.unlock(task.nodes)
            elif status is not KVResponseStatus.SUCCESS or task.discarded:
                index.remove_pending(task.nodes)
            elif self.config.deferred_visibility:
                key = task.batch.id if task.batch is not None else task.id
                self._unpublished.setdefault(key, []).append(task.nodes)
                self._unpublished_by[key] = task.tenant
                if task.tokens is not None:
                    self._event_tokens.setdefault(key, []).append(task.tokens)
            else:
                index.publish(task.nodes)
                if task.tokens is not None:
                    self._announce_locked(task.nodes, task.tokens)
                self._remote_write_locked(task.nodes)
                if self._metrics is not None:
                    self._metrics.stored_tokens.inc(len(task.nodes) * self.tokens_per_block)
        batch = task.batch
        if batch is not None and batch.status is None and all(
            m.status is not None for m in batch.members
        ):
            failed = [m for m in batch.members if m.status is not KVResponseStatus.SUCCESS]
            batch.status = failed[0].status if failed else KVResponseStatus.SUCCESS
            batch.error = failed[0].error if failed else None
            batch.finished_at = task.finished_at
            batch.state = TaskState.DONE
        self._update_gauges()

    def _reap_locked(self, task: Task) -> KVResponse:
        self._tasks.pop(task.id, None)
        for m in task.members:
            self._members.pop(m.id, None)
        return task.response()

    def _abort_locked(self, task: Task) -> None:
        """Ask ``task``'s copy (every member's, for a batch) to stop."""
        for m in task.members or [task]:
            m.abort.set()

    def _abort_running_locked(self) -> list[Task]:
        """Abort every launched, unfinished copy; returns those tasks."""
        running = [t for t in [*self._tasks.values(), *self._members.values()]
                   if t.future is not None and t.status is None]
        for t in running:
            t.abort.set()
        return running

    def _cancel_unlaunched_locked(self) -> None:
        for t in list(self._tasks.values()):
            if t.state is TaskState.MATCHED and not t.members:
                self._finish_locked(t, KVResponseStatus.CANCELLED, "cancelled by reset/shutdown")
        self._unlaunched.clear()

    def _expire_locked(self) -> None:
        """Cancel matches left un-launched past their deadline (they unlock)."""
        now = self._clock()
        q = self._unlaunched
        expired = False
        while q and (q[0].state is not TaskState.MATCHED or q[0].deadline <= now):
            t = q.popleft()
            if t.state is TaskState.MATCHED and t.status is None and t.batch is None:
                self._finish_locked(t, KVResponseStatus.CANCELLED,
                                    f"match not launched within "
                                    f"{self.config.unlaunched_match_seconds} s")
                expired = True
                log.warning("Un-launched match expired", extra={"task_id": t.id})
        c = self._claimed
        while c and (c[0].state is not TaskState.CLAIMED or c[0].status is not None
                     or c[0].deadline <= now):
            t = c.popleft()
            if t.state is TaskState.CLAIMED and t.status is None:
                # Unpinned: its blocks may be reused, and end_claim answers False.
                self._finish_locked(t, KVResponseStatus.CANCELLED,
                                    "the engine's copy did not end within its claim")
                expired = True
                log.warning("Claimed load expired before the engine ended it",
                            extra={"task_id": t.id})
        if expired:
            self._cond.notify_all()

    def _purge_unreaped_locked(self) -> None:
        """Drop tasks finished longer ago than the match expiry and never reaped (their
        callers are gone); keeps the bounded table from filling with orphans."""
        horizon = self._clock() - self.config.unlaunched_match_seconds
        stale = [t for t in self._tasks.values()
                 if t.status is not None and t.finished_at < horizon]
        for t in stale:
            self._reap_locked(t)

    def _tick_seconds(self) -> float:
        return min(0.5, self.config.unlaunched_match_seconds / 4)

    def _reap_loop(self) -> None:
        while not self._stopping.wait(self._tick_seconds()):
            with self._cond:
                if self._index is not None and not self._closed:
                    self._expire_locked()
                    self._purge_unreaped_locked()

    def _observe_match(self, op: str, t0: float) -> None:
        if self._metrics is not None:
            self._child(self._metrics.match_seconds, op=op).observe(time.perf_counter() - t0)

    def _child(self, metric: Any, **labels: str) -> Any:
        """``metric.labels(**labels)``, kept: prometheus_client's ``labels`` takes a
        lock and validates the names on every call (about 3-10 us), too much for
        every match and copy. The agent never removes these label sets."""
        key = (id(metric), *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**labels)
        return child

    def _count_spill_failures_locked(self) -> None:
        """Add the index's new spill failures (SSD writes that failed; the block was
        dropped instead) to ``flexkv_agent_ssd_errors_total{op="spill"}``."""
        index = self._index
        if self._metrics is None or index is None:
            return
        if index.spill_failures < self._spill_failures_counted:  # a new index
            self._spill_failures_counted = 0
        new = index.spill_failures - self._spill_failures_counted
        if new:
            self._metrics.ssd_errors.labels(op="spill").inc(new)
            self._spill_failures_counted = index.spill_failures

    def _update_gauges(self) -> None:
        """Set the tier gauges; skipped when no tier's size or use changed (most
        matches and cancels), which keeps label look-ups off the lookup path."""
        m, index = self._metrics, self._index
        if m is None or index is None:
            return
        bpb = self.config.layout.bytes_per_block
        values = tuple((index.capacity[tier] * bpb, index.used(tier) * bpb)
                       for tier in (Tier.CPU, Tier.SSD))
        if values == self._gauges_set:
            return
        self._gauges_set = values
        for tier, (capacity, used) in zip((Tier.CPU, Tier.SSD), values, strict=True):
            m.tier_capacity_bytes.labels(tier=tier.value).set(capacity)
            m.tier_used_bytes.labels(tier=tier.value).set(used)
        if index.capacity[Tier.SSD]:  # exported at 0: an alert sees the first error
            m.ssd_errors.labels(op="spill")

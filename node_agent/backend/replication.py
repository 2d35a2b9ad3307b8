"""How a PP group keeps every stage's cache identical: the leader decides, stages execute.

A pipeline-parallel engine replica has one stage per node; each stage holds the KV
of its own layers. Only the group leader owns an index and makes decisions (FlexKV's
model: the master decides, remote transfer managers execute). Every decision is
expressed in *physical* terms so followers never match, allocate or evict on their
own, and every stage holds the same blocks at the same places:

* a store or load is a :class:`TransferPlan`: the tier blocks of each masked block,
  in token order, plus the slots each stage takes from its own ``kv_indices``;
* tier movement (a CPU block spilled to SSD, a block dropped) is a :class:`TierMove`,
  decided by the leader and applied by every stage in the same ordered stream.

Two roles implement this module's interfaces:

* :class:`StageStore` is a stage's storage without an index: tiers of a fixed
  number of blocks and a transfer engine. Followers use it directly; the leader's
  backend is built on one.
* :class:`ReplicatedBackend` is the leader-side extension of
  :class:`~node_agent.backend.base.KVBackend`: it exposes each task's plan, the
  moves it decided, and holds finished stores invisible until every stage has
  finished them (docs/pp.md, "Stores, loads and acks").
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from node_agent.backend.base import BoolMask, KVBackend, SlotArray, TokenArray
from node_agent.vocab.placement import Tier, TierMove, TransferPlan

if TYPE_CHECKING:
    import torch


class CopyStillRunningError(TimeoutError):
    """:meth:`StageStore.execute` timed out and its copy did not stop after its
    abort (a hung device): it may still write the plan's engine slots (a LOAD) or
    read them (a STORE) at any later time; the store keeps the plan's blocks fenced
    until it ends."""


class StageStore(abc.ABC):
    """Index-free storage of one PP stage, addressed by physical block.

    Thread safety: ``execute`` may run concurrently for plans whose blocks do
    not overlap; ``apply_moves`` is called in stream order.
    """

    @abc.abstractmethod
    def register_kv_buffers(
        self, rank: int, buffers: Sequence[Sequence[torch.Tensor]]
    ) -> None:
        """Register this stage's engine rank buffers; same contract as
        :meth:`KVBackend.register_kv_buffers`."""

    @abc.abstractmethod
    def num_blocks(self, tier: Tier) -> int:
        """Capacity of ``tier`` in blocks (0 when the tier is not configured)."""

    @abc.abstractmethod
    def execute(self, plan: TransferPlan, slot_mapping: SlotArray, timeout: float,
                stop_timeout: float | None = None) -> None:
        """Copy between this stage's registered engine buffers and ``plan``'s blocks.

        Validates ``slot_mapping`` first (1-D integer, length
        ``len(plan.blocks) * tokens_per_block``, in range, non-negative, no
        duplicates) and raises ``ValueError`` naming the bad value with nothing
        copied.

        Copies are stoppable: when the copy does not finish in ``timeout`` seconds,
        ``execute`` requests it to stop, waits until it has stopped (it checks
        between run / plane copies), and only then raises ``TimeoutError``. After
        ``execute`` returns or raises, nothing writes the engine slots or the
        plan's blocks any more, except when the copy does not stop within the
        store's own bound after its abort (a hung device): then it raises
        :class:`CopyStillRunningError` (a ``TimeoutError``) and the copy may still
        write the slots. After a LOAD timed out the slots hold undefined
        data and must not be used; after a STORE timed out the blocks are not
        stored (the leader discards the put). ``stop_timeout``: how long to wait
        for an aborted copy to stop (None: the store's own bound), so a caller
        answering an engine keeps the whole call within its budget.
        """

    @abc.abstractmethod
    def apply_moves(self, moves: Sequence[TierMove], remote: bool = True) -> None:
        """Apply leader-decided tier moves in order (copy, then the source is free).

        ``remote`` False: the moves were made under another cache epoch than this
        stage's, so their REMOTE part is refused: a REMOTE -> CPU fetch reads
        nothing and leaves its CPU block unloadable (a later load of it fails),
        a CPU -> REMOTE write is skipped; every other move applies."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every block's content (a flush); registered buffers stay."""


class ReplicatedBackend(KVBackend):
    """Leader-side backend of a PP group: a :class:`KVBackend` whose decisions can
    be replayed on other stages.

    Construct it with deferred visibility: a put task that finishes SUCCESS
    locally keeps its blocks invisible to ``get_match`` until :meth:`publish`
    (every stage finished) or :meth:`discard` (some stage failed).
    """

    @abc.abstractmethod
    def plan_of(self, task_id: int) -> TransferPlan:
        """The physical plan of a matched task (valid from match until reaped).

        Raises ``TaskNotFoundError`` for an unknown id.
        """

    @abc.abstractmethod
    def drain_moves(self) -> list[TierMove]:
        """Tier moves decided since the last call, in decision order.

        The leader sends them to the followers *before* any plan issued after
        them, because a later plan may reuse a block a move freed.
        """

    @abc.abstractmethod
    def publish(self, task_id: int) -> None:
        """Make a finished put's blocks visible to lookups (all stages stored them)."""

    @abc.abstractmethod
    def discard(self, task_id: int) -> None:
        """Drop a put whose blocks some stage failed to store: the blocks stay
        invisible and their space is freed. Idempotent."""

    #: Whether :meth:`get_match` itself fetches blocks that only a slow tier (the
    #: remote tier) holds. A caller that runs :meth:`prefetch` before every
    #: ``get_match`` sets it False, so its matches never wait on such a fetch.
    fetch_in_match: bool = True

    def prefetch(self, token_ids: TokenArray, token_mask: BoolMask | None = None,
                 namespace: str | None = None) -> None:
        """Bring the blocks of a prompt that only a slow tier holds into the cache,
        ahead of :meth:`get_match` (which then finds them). Thread-safe and callable
        while other matches run: it decides nothing but the tier moves it queues for
        :meth:`drain_moves`, which reach the followers before any plan that reads the
        blocks. Never raises for a slow tier's failure (a shorter hit). The default
        does nothing."""

    def peek(self, token_ids: TokenArray) -> dict[str, int] | None:
        """Tokens of the cached prefix of ``token_ids`` by local tier (``cpu``,
        ``ssd``), read-only: no task, no pin, no LRU touch, no backend lock, no fetch;
        an advisory snapshot that a concurrent store or eviction may or may not be
        in. None when the backend cannot answer so (the default)."""
        return None

    def tier_handle(self) -> dict[str, Any] | None:
        """The shared CPU tier an engine may map read-only to copy claimed loads
        itself (:meth:`claim_rows`), or None when loads are only copied here (the
        default)."""
        return None

    def claim_rows(self, task_id: int, lease: float) -> list[int] | None:
        """Hand an un-launched get's copy to the engine: the CPU tier block of each
        matched block, in token order, which stay pinned (never evicted or
        rewritten) until :meth:`end_claim` or until ``lease`` seconds passed. None
        (the task still un-launched: launch it instead) when the engine cannot copy
        it itself: no shared tier, or a block on another tier. The default: None.
        Raises ``TaskNotFoundError`` for a task that is not a live, un-launched get."""
        return None

    def claim_fence(self, task_id: int) -> int | None:
        """The shared tier's claim fence as it was when task ``task_id`` was claimed
        (:meth:`claim_rows`; the fence: docs/agent.md, "Engine-side loads"): an
        engine that reads the same value after its copy read only pinned blocks. None
        when the task is no longer claimed or the tier has no fence (the engine must
        then ask :meth:`end_claim`). The default: None."""
        return None

    def end_claim(self, task_id: int, committed: bool = True) -> bool:
        """The engine's copy of a claimed get ended: True when the blocks stayed
        pinned for the whole claim (the bytes it read are the cached KV), False when
        the claim had already ended (lease expired, reset, stage left: the blocks
        may have been rewritten, so the engine must treat its slots as not loaded).
        The task is forgotten either way. ``committed`` False: no engine commit ends
        it (a release, a new lookup of its rid): counted apart in the metrics."""
        return False

    def refetch_failed(self, task_id: int) -> None:
        """A load task some other stage could not execute (say, its fetch of the
        task's blocks from a slow tier failed there): the task's blocks that came
        from such a tier are fetched again on the other stages (moves queued by
        the next match that loads them), so the next lookup of the prefix can
        hit. Call it before the task is cancelled. The default does nothing."""

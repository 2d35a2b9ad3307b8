"""A stage's tiers without an index: the :class:`~.replication.StageStore` of this project.

PP followers use :class:`TierStore` directly, executing the leader's plans and
moves; the leader's :class:`~.embedded.EmbeddedBackend` is built on one, so
leader and followers run the same copy code over identically sized tiers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.cpu_tier import CpuTier
from node_agent.backend.planes import RegisteredBuffers, register_buffers
from node_agent.backend.replication import CopyStillRunningError, StageStore
from node_agent.backend.slots import launch_slots
from node_agent.backend.ssd_format import HASH_BYTES, tier_identity
from node_agent.backend.ssd_tier import SsdTier
from node_agent.backend.transfer import BlockCopier
from node_agent.vocab.layout import KVLayout
from node_agent.vocab.placement import BlockLocation, Direction, Tier, TierMove, TransferPlan

if TYPE_CHECKING:
    from node_agent.backend.remote.tier import RemoteTier
    from node_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

#: How long ``apply_moves`` waits for a timed-out copy still writing a moved block.
FENCE_SECONDS = 30.0
#: How long ``execute`` waits, after its timeout, for the aborted copy to stop. A
#: copy checks its abort flag before every run / plane copy, so it stops within one
#: of those (milliseconds); only a hung device can exceed this bound.
STOP_SECONDS = 10.0


def _describe(blocks: Sequence[BlockLocation], limit: int = 4) -> str:
    """``blocks cpu:3, cpu:4, ssd:7``: text naming up to ``limit`` blocks."""
    shown = ", ".join(f"{b.tier.value}:{b.index}" for b in blocks[:limit])
    more = f" and {len(blocks) - limit} more" if len(blocks) > limit else ""
    return f"blocks {shown}{more}"


class TierStore(StageStore):
    """CPU (and optional SSD) tiers of one stage plus its registered engine buffers.

    Sized from an :class:`EmbeddedBackendConfig` so that every stage of a group,
    given the same config, has the same number of blocks per tier.

    With a ``remote`` tier (docs/remote.md) it also applies the leader's REMOTE
    moves: REMOTE -> CPU fetches this stage's own copy of the block (its keys carry
    its PP rank) and CPU -> REMOTE offers the block to the write-behind queue. A
    CPU block whose fetch failed is *poisoned*: a load plan naming it fails (the
    stage reports a miss) until a store or move writes the block again.

    With ``metrics`` (a follower stage's store) every plan :meth:`execute` completed
    is counted in ``flexkv_agent_transfer_bytes{direction,tier}``, as the leader's
    backend counts its own copies.
    """

    def __init__(self, config: EmbeddedBackendConfig, remote: RemoteTier | None = None,
                 metrics: AgentMetrics | None = None) -> None:
        self.config = config
        self._metrics = metrics
        self.layout: KVLayout = config.layout
        self.cpu = CpuTier(config.layout, config.cpu_blocks, config.pinned,
                           config.cpu_shared)
        self.ssd = (
            SsdTier(config.layout.bytes_per_block, config.ssd_blocks, config.ssd_paths,
                    identity=tier_identity(config) if config.ssd_persist else None,
                    hash_bytes=HASH_BYTES[config.hash_algorithm], pool=config.pool,
                    budget_slots=config.ssd_shares)
            if config.ssd_blocks
            else None
        )
        self.copier = BlockCopier(config.layout, self.cpu, self.ssd, config.copy_lanes)
        self._buffers: dict[int, dict[int, RegisteredBuffers]] = {}
        """Tenant (stage sharing these tiers; 0: the store's own) -> rank -> buffers."""
        self._fences: dict[BlockLocation, threading.Thread] = {}
        self._lock = threading.Lock()
        self.remote = remote
        self._poisoned: set[BlockLocation] = set()
        if remote is not None:
            remote.attach(self.cpu)

    # -- registration -------------------------------------------------------

    def register_kv_buffers(
        self, rank: int, buffers: Sequence[Sequence[torch.Tensor]]
    ) -> None:
        """Validate and keep rank ``rank``'s buffers (see ``KVBackend.register_kv_buffers``)."""
        reg = register_buffers(self.layout, rank, buffers)
        self.add_registered(reg)
        log.info("Engine rank registered KV buffers",
                 extra={"rank": rank, "slots": reg.num_slots, "device": str(reg.device)})

    def add_registered(self, reg: RegisteredBuffers, tenant: int = 0) -> None:
        """Keep already validated buffers (replacing the rank's previous ones) of
        ``tenant``: the stage whose engine they belong to when several stages share
        these tiers (:mod:`node_agent.backend.shared`; 0 for the store's own stage)."""
        if reg.planes and len(reg.planes) != self.layout.num_planes:
            raise ValueError(
                f"rank {reg.rank} buffers have {len(reg.planes)} planes, expected "
                f"{self.layout.num_planes}; validate them with this store's layout"
            )
        with self._lock:
            self._buffers = {**self._buffers,
                             tenant: {**self._buffers.get(tenant, {}), reg.rank: reg}}

    def drop_tenant(self, tenant: int) -> None:
        """Forget every buffer of ``tenant`` (its stage left the shared tiers); the
        caller made sure no copy of that stage is running."""
        with self._lock:
            self._buffers = {t: b for t, b in self._buffers.items() if t != tenant}

    @property
    def registered_ranks(self) -> tuple[int, ...]:
        """Ranks whose buffers are registered, sorted (the store's own stage)."""
        return self.ranks_of(0)

    def ranks_of(self, tenant: int) -> tuple[int, ...]:
        """Ranks of ``tenant`` whose buffers are registered, sorted."""
        return tuple(sorted(self._buffers.get(tenant, {})))

    def is_complete(self, tenant: int = 0) -> bool:
        """True when every expected rank of ``tenant`` registered."""
        return len(self._buffers.get(tenant, {})) == self.config.expected_ranks

    def buffers(self, tenant: int = 0) -> dict[int, RegisteredBuffers]:
        """The registered buffers of ``tenant`` (a snapshot); raises when a rank is
        missing."""
        bufs = self._buffers.get(tenant, {})
        if len(bufs) != self.config.expected_ranks:
            missing = sorted(set(range(self.config.expected_ranks)) - set(bufs))
            raise RuntimeError(
                f"engine ranks {missing} have not registered KV buffers; register every rank "
                "before launching transfers"
            )
        return bufs

    def num_slots(self, tenant: int = 0) -> int:
        """Slots valid in every registered rank of ``tenant`` (the smallest buffer)."""
        bufs = self.buffers(tenant)
        return min(b.num_slots for b in bufs.values())

    # -- StageStore ---------------------------------------------------------

    def num_blocks(self, tier: Tier) -> int:
        if tier is Tier.CPU:
            return self.cpu.num_blocks
        if tier is Tier.SSD:
            return self.ssd.num_blocks if self.ssd is not None else 0
        return 0  # REMOTE blocks are addressed by block id, never by a plan

    def check_plan(self, plan: TransferPlan) -> None:
        """Raise ``ValueError`` when a plan names a block outside this stage's tiers."""
        for loc in plan.blocks:
            if plan.direction is Direction.STORE and loc.tier is not Tier.CPU:
                raise ValueError(f"a store plan names {loc}; stores only target the CPU tier")
            if not 0 <= loc.index < self.num_blocks(loc.tier):
                raise ValueError(
                    f"plan names {loc.tier.value} block {loc.index} but this stage has "
                    f"{self.num_blocks(loc.tier)}; every stage of a group needs the same tier sizes"
                )
        if self._poisoned and plan.direction is Direction.LOAD:
            bad = [b for b in plan.blocks if b in self._poisoned]
            if bad:
                raise ValueError(
                    f"plan loads {_describe(bad)} whose fetch from the remote tier failed on "
                    "this stage; the load is a miss (the blocks are rewritten by a later store)"
                )

    def copy(self, plan: TransferPlan, slots: torch.Tensor,
             abort: threading.Event | None = None, tenant: int = 0) -> None:
        """Run ``plan`` with already validated ``slots`` of ``tenant``'s engine
        buffers in the calling thread.

        Raises :class:`~.transfer.CopyAborted` once ``abort`` is set (checked before
        every run / plane copy); what the copy wrote by then is undefined."""
        bufs = self.buffers(tenant)
        if plan.direction is Direction.STORE:
            self._written([b.index for b in plan.blocks])
            self.copier.store(bufs, [b.index for b in plan.blocks], slots, abort)
        else:
            self.copier.load(bufs, plan.blocks, slots, abort)

    def execute(self, plan: TransferPlan, slot_mapping: object, timeout: float,
                stop_timeout: float | None = None) -> None:
        """See :meth:`StageStore.execute`. On timeout the copy's abort flag is set and
        its thread joined (it stops within one run / plane copy) before
        ``TimeoutError`` is raised, so nothing writes the plan's slots or blocks
        afterwards. Only when the copy does not stop within ``stop_timeout``
        (``STOP_SECONDS`` when None; a hung device) does it keep running: its
        blocks then stay *fenced* (a later plan or
        move touching them first waits for it) and the error is a
        :class:`~.replication.CopyStillRunningError`."""
        deadline = time.monotonic() + timeout
        self.check_plan(plan)
        slots = launch_slots(
            slot_mapping, len(plan.blocks) * self.layout.tokens_per_block, self.num_slots()
        )
        self._await_fences(plan.blocks, deadline)
        outcome: list[BaseException | None] = []
        abort = threading.Event()

        def run() -> None:
            try:
                self.copy(plan, slots, abort)
                outcome.append(None)
            except BaseException as e:  # handed to the waiting caller
                outcome.append(e)

        worker = threading.Thread(target=run, name="flexkv-stage-copy", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        if not worker.is_alive():
            if outcome and outcome[0] is not None:
                raise outcome[0]
            self._count(plan)
            return
        abort.set()
        stop = STOP_SECONDS if stop_timeout is None else max(0.0, stop_timeout)
        worker.join(stop)
        what = (f"{plan.direction.value} of {len(plan.blocks)} blocks "
                f"({_describe(plan.blocks)}) did not finish in {timeout} s")
        if plan.direction is Direction.LOAD:
            consequence = ("the engine slots hold undefined data and must not be used; "
                           "recompute their KV")
        else:
            consequence = "the blocks are not stored; discard the put"
        if worker.is_alive():
            with self._lock:
                for loc in plan.blocks:
                    self._fences[loc] = worker
            log.error("Aborted copy still running", extra={
                "direction": plan.direction.value, "blocks": len(plan.blocks),
                "stop_seconds": stop})
            raise CopyStillRunningError(
                f"{what} and did not stop within {stop:g} s of the abort (hung "
                f"device?); it may still write; {consequence}"
            )
        raise TimeoutError(f"{what}; the copy was stopped; {consequence}")

    def _count(self, plan: TransferPlan) -> None:
        if self._metrics is None:
            return
        bpb = self.layout.bytes_per_block
        for tier in (Tier.CPU, Tier.SSD):
            k = sum(1 for b in plan.blocks if b.tier is tier)
            if k:
                self._metrics.transfer_bytes.labels(direction=plan.direction.value,
                                                    tier=tier.value).inc(k * bpb)

    def apply_moves(self, moves: Sequence[TierMove], remote: bool = True) -> None:
        """See :meth:`StageStore.apply_moves`; waits (up to ``FENCE_SECONDS``) for a
        timed-out copy still writing a block the moves touch."""
        deadline = time.monotonic() + FENCE_SECONDS
        fetches: list[TierMove] = []
        for m in moves:
            if m.src.tier is Tier.REMOTE:
                fetches.append(m)  # consecutive fetches go in one batch
                continue
            if fetches:
                self._fetch(fetches, deadline, remote)
                fetches = []
            if m.dst is not None and m.dst.tier is Tier.REMOTE:
                if remote:
                    self._remote().offer([m.dst.index], [m.src.index])
                continue
            self._await_fences([m.src] if m.dst is None else [m.src, m.dst], deadline)
            if m.dst is not None:
                if m.dst.tier is Tier.CPU:
                    self._written([m.dst.index])
                self.copier.move(m.src, m.dst)
                if self._poisoned:  # a poisoned block stays poisoned where it moves
                    if m.src in self._poisoned:
                        self._poisoned.add(m.dst)
                    else:
                        self._poisoned.discard(m.dst)
        if fetches:
            self._fetch(fetches, deadline, remote)

    def _written(self, cpu_blocks: Sequence[int]) -> None:
        """``cpu_blocks`` are about to be overwritten: a pending remote write of their
        old content is void, and a poisoned block is healed by the new content."""
        if self.remote is not None:
            self.remote.bump(cpu_blocks)
        if self._poisoned:
            self._poisoned.difference_update(BlockLocation(Tier.CPU, i) for i in cpu_blocks)

    def _remote(self) -> RemoteTier:
        if self.remote is None:
            raise ValueError(
                "a move names the remote tier but this stage has none; every stage of a "
                "group needs the same tiers (tiers.remote in agent.yaml)"
            )
        return self.remote

    def _fetch(self, moves: Sequence[TierMove], deadline: float, allowed: bool = True) -> None:
        """REMOTE -> CPU moves: fetch this stage's own copy of each block (its keys carry
        its PP rank). Blocks after the first that did not arrive are poisoned; with
        ``allowed`` False (another cache epoch's moves) nothing is fetched and every
        destination block is poisoned."""
        remote = self._remote()
        dst = []
        for m in moves:
            if m.dst is None or m.dst.tier is not Tier.CPU:
                raise ValueError(f"move {m} must fetch a remote block into a CPU block")
            dst.append(m.dst.index)
        self._await_fences([m.dst for m in moves if m.dst is not None], deadline)
        self._written(dst)
        got = 0
        if allowed:
            got = remote.fetch([m.src.index for m in moves], dst,
                               remote.settings.timeout_seconds)
        if got < len(dst):
            self._poisoned.update(BlockLocation(Tier.CPU, i) for i in dst[got:])
            log.warning("Stage could not fetch remote blocks; loads of them are misses",
                        extra={"blocks": len(dst) - got})

    def _await_fences(self, blocks: Sequence[BlockLocation], deadline: float) -> None:
        """Wait for timed-out copies still writing any of ``blocks``; TimeoutError if
        one is still running at ``deadline``."""
        with self._lock:
            if not self._fences:
                return
            waits = {self._fences[b] for b in blocks if b in self._fences}
        for worker in waits:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                fenced = [b for b in blocks if self._fences.get(b) is worker]
                raise TimeoutError(
                    f"an earlier copy into {_describe(fenced)} timed out, ignored its abort "
                    f"and was still running after this call waited until its deadline; "
                    "retry later or treat the blocks as not stored"
                )
        with self._lock:
            self._fences = {b: w for b, w in self._fences.items() if w.is_alive()}

    def reset(self) -> None:
        """Nothing to forget: the store keeps no index, and every later plan overwrites
        the blocks it names before any load reads them. Remote writes still queued are
        voided (their blocks count as overwritten), a remote fetch in flight stops
        writing CPU blocks, and poisoned blocks are forgotten."""
        if self.remote is not None:
            self.remote.invalidate()
        self._poisoned.clear()

    def read_block(self, location: BlockLocation) -> bytes:
        """The raw bytes of one block (region order), for checks and debugging."""
        if location.tier is Tier.CPU:
            return self.cpu.read_block(location.index)
        if self.ssd is None:
            raise ValueError(f"{location} names the SSD tier but this stage has none")
        return self.ssd.read_block(location.index)

    def close(self) -> None:
        """Release the SSD files, stop the remote writer and stop handing out a
        shared CPU tier."""
        self.cpu.close()
        if self.ssd is not None:
            self.ssd.close()
        if self.remote is not None:
            self.remote.close()

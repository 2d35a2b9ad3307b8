"""Loads an engine rank copies itself, from its agent's shared CPU tier.

Where the agent's CPU tier is a shared memory file (an unpinned tier of a
single-stage group, docs/agent.md "Engine-side loads"), an engine on the node
gets a read-only descriptor of it from the agent's tier socket, maps it and
copies a hit straight into its own KV buffers, with the agent's own copy code
(:class:`~node_agent.backend.transfer.BlockCopier`), while the agent keeps the
index, the pins and the ordering:

1. ``lookup`` (as always) matches and pins the hit blocks;
2. ``claim_load`` hands out the tier block of each hit block; they stay pinned
   (never evicted, never rewritten) until ``commit_load`` or the claim's lease
   (the agent's transfer budget) ends; ``lookup_claim`` makes steps 1 and 2 in
   one round trip (:meth:`EngineLoads.lookup`);
3. the engine copies;
4. the claim is ended. When the agent's *claim fence* (a counter in the page after
   the tier's blocks, :mod:`node_agent.backend.cpu_tier`) reads, after the copy,
   what the agent recorded when it made the claim, no claim ended early in
   between, so every block the copy read was still pinned: the load is a hit,
   and ``commit_load`` is sent without waiting for its answer (it only unpins).
   Otherwise ``commit_load`` answers whether this claim still held when the copy
   ended. Only then are the slots the cached KV; on False (lease over, a flush,
   the agent restarted) they hold undefined data and the load is a miss.

The tier mapping is read-only, so an engine can never change a cached block, and
a block can be reused only after its claim ended, which moves the fence first:
a copy that may have read a reused block is never reported as loaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from node_agent.backend.cpu_tier import MappedTier, check_tier_handle, map_tier_fd
from node_agent.backend.planes import RegisteredBuffers, register_buffers
from node_agent.backend.slots import launch_slots
from node_agent.backend.tier_fds import receive_tier_fd, tier_socket_path
from node_agent.backend.transfer import BlockCopier
from node_agent.client import EngineAPIError, EngineClient
from node_agent.vocab.layout import KVLayout
from node_agent.vocab.placement import Tier, block_locations

log = logging.getLogger(__name__)


_ORDER = threading.Lock()


def _order_reads() -> None:
    """Order the copy's reads of tier blocks before the fence read that follows,
    also on weakly ordered CPUs (a copy on this thread has no join): a lock
    released and then taken again is a full barrier between them."""
    with _ORDER:
        pass
    with _ORDER:
        pass


class _Unmappable(ValueError):
    """The agent's tier handle or descriptor cannot be used by this process."""


class EngineLoads:
    """One engine rank's loads by its own copy (see module docstring).

    ``buffers``: the rank's KV buffers as registered with the agent (the same
    tensors, arranged as ``layout`` names them); checked here as the agent checks
    them. ``lanes``: threads sharing one large copy. Not thread-safe: one load at a
    time (the client serialises its calls anyway)."""

    def __init__(self, client: EngineClient, layout: KVLayout,
                 buffers: Sequence[Sequence[torch.Tensor]], lanes: int = 2) -> None:
        self.client = client
        self.layout = layout
        self.lanes = lanes
        self.tier_socket = tier_socket_path(str(client.socket_path))
        """The agent's tier socket, where the tier's descriptor is asked for."""
        self._reg: RegisteredBuffers = register_buffers(layout, client.rank.tp_rank, buffers)
        self._tier: MappedTier | None = None
        self._copier: BlockCopier | None = None
        self.unavailable: str | None = None
        """Why loads are no longer copied here (the tier could not be received or
        mapped: say, this process cannot reach the agent's tier socket); None while
        they are."""
        self._claims: dict[str, dict[str, Any]] = {}
        """rid -> what its ``lookup_claim`` handed out, until its load or release."""
        self.loads = 0
        """Loads copied here and committed."""
        self.misses = 0
        """Claims whose commit answered False (their slots were not loaded)."""
        self.fenced = 0
        """Loads of :attr:`loads` known to hold by the claim fence alone (their
        commit sent without waiting)."""

    def prepare(self) -> bool:
        """Map the agent's tier now, off any load's path (mapping populates every
        page of it, which takes a while for a large tier); True when mapped. A
        tier this process cannot reach or map turns engine-side loads off, as in
        :meth:`load`."""
        if self.unavailable is not None:
            return False
        handle = self.client.tier()
        if handle is None:
            return False
        try:
            self._copier_for(handle)
        except (OSError, ValueError) as exc:
            self._not_mapped(exc, None)
            return False
        return True

    def lookup(self, rid: str, token_ids: Any, token_mask: Any = None) -> int:
        """``client.lookup`` that also claims the hit (``lookup_claim``): the hit
        tokens; :meth:`load` then copies them without another claim call. The
        claim's lease runs from now, so load soon; a claim left unused is ended by
        :meth:`release`."""
        if self.unavailable is not None:
            return int(self.client.lookup(rid, token_ids, token_mask))
        got = self.client.lookup_claim(rid, token_ids, token_mask)
        self._claims.pop(rid, None)
        if got.get("blocks"):
            self._claims[rid] = got
        elif not got.get("tier") or (self._tier is not None
                                     and got["tier"].get("id") != self._tier.tier_id):
            # The agent has no shared tier, or another one (it restarted): drop the
            # mapping now, whose memory would otherwise stay with this process.
            self.close()
        return int(got["hit"])

    def release(self, rid: str) -> None:
        """``client.release``: ends ``rid``'s lookup and an unused claim of it."""
        self._claims.pop(rid, None)
        self.client.release(rid)

    def load(self, rid: str, slot_mapping: Any) -> int | None:
        """Load what the last lookup of ``rid`` hit into ``slot_mapping`` (one
        slot per hit token) by copying it here: the claim :meth:`lookup` made, else
        one ``claim_load`` now. Returns the tokens loaded (0: a miss; the slots hold
        undefined data), or None when the agent cannot hand this load out (the
        lookup stays open: call ``client.retrieve``). Raises ``ValueError`` for a
        bad slot mapping (the claim is ended first: a miss)."""
        got = self._claims.pop(rid, None)
        if got is None and self.unavailable is None:
            got = self.client.claim_load(rid)
        if got is None:
            return None
        hit, blocks, claim = int(got["hit"]), list(got["blocks"]), int(got.get("claim", -1))
        if not blocks:
            return 0
        try:
            slots = launch_slots(slot_mapping, hit, self._reg.num_slots,
                                 "claim_load: slot_mapping")
            try:
                copier = self._copier_for(got["tier"])
            except (OSError, ValueError) as exc:
                self._not_mapped(exc, rid)
                self._end_claim(rid, claim)
                return 0  # the claim is over; this load is a miss
            copier.load({self._reg.rank: self._reg}, block_locations(Tier.CPU, blocks), slots)
        except BaseException:
            self._end_claim(rid, claim)  # the load is a miss
            raise
        if self._held_by_fence(got):
            if not self.client.end_claim_nowait(rid, claim):
                log.warning("Commit of a load the claim fence showed held was not sent; "
                            "its blocks stay pinned until the claim's lease ends",
                            extra={"rid": rid, "socket": str(self.client.socket_path)})
            self.loads += 1
            self.fenced += 1
            return hit
        if self._commit(rid, claim):
            self.loads += 1
            return hit
        self.misses += 1
        log.warning("Claimed load ended before its copy did; the load is a miss",
                    extra={"rid": rid, "hit_tokens": hit})
        return 0

    def _held_by_fence(self, got: dict[str, Any]) -> bool:
        """Whether the claim fence shows that ``got``'s claim held through the copy
        just ended: it reads now what the agent recorded at the claim. Read after
        the copy's threads ended (their reads come first); the agent moves it
        before any claimed block can be reused."""
        recorded, tier = got.get("fence"), self._tier
        if not isinstance(recorded, int) or isinstance(recorded, bool) or tier is None:
            return False
        _order_reads()
        return tier.fence_value() == recorded

    def _not_mapped(self, exc: BaseException, rid: str | None) -> None:
        """The tier could not be received or mapped. When this process cannot reach
        the tier socket at all (no such file, no permission) or cannot map what it
        got, engine-side loads stop for good (:attr:`unavailable`); anything else
        (a busy or restarting agent, a tier id that just changed) costs this load
        only."""
        lasting = isinstance(exc, FileNotFoundError | PermissionError | _Unmappable)
        if lasting:
            self.unavailable = f"{type(exc).__name__}: {exc}"
        log.warning("Cannot map the agent's CPU tier" + (
            "; loads are copied by the agent from now on" if lasting else ", a miss"),
            extra={"rid": rid, "error": str(exc), "socket": self.tier_socket})

    def _commit(self, rid: str, claim: int) -> bool:
        """``commit_load``; an agent that no longer knows the claim (it restarted
        since) answers as for a claim that ended: a miss."""
        try:
            return self.client.commit_load(rid, claim)
        except EngineAPIError as exc:
            if exc.error_type != "KeyError":
                raise
            log.warning("The agent no longer knows the claim; the load is a miss",
                        extra={"rid": rid, "error": str(exc)})
            return False

    def _end_claim(self, rid: str, claim: int) -> None:
        """End ``rid``'s claim after a failed copy (its answer no longer matters)."""
        with contextlib.suppress(Exception):
            self.client.commit_load(rid, claim)

    def _copier_for(self, handle: Any) -> BlockCopier:
        """The copier over the tier ``handle`` names, mapping it (again, when the
        agent's tier changed: a restarted agent or a new stage)."""
        try:
            tier_id, _, _ = check_tier_handle(self.layout, handle)
        except ValueError as exc:
            raise _Unmappable(str(exc)) from exc
        if self._copier is None or self._tier is None or self._tier.tier_id != tier_id:
            self.close()
            fd = receive_tier_fd(self.tier_socket, tier_id)
            try:
                self._tier = map_tier_fd(self.layout, handle, fd)
            except (OSError, ValueError) as exc:
                raise _Unmappable(f"{type(exc).__name__}: {exc}") from exc
            finally:
                os.close(fd)
            self._copier = BlockCopier(self.layout, self._tier.tier, None, self.lanes)
        return self._copier

    def close(self) -> None:
        """Drop the tier mapping (a later load maps it again)."""
        self._copier = None
        tier, self._tier = self._tier, None
        if tier is not None:
            tier.close()

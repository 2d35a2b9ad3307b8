"""The CPU tier: one preallocated, optionally pinned or shared pool of blocks.

The pool is one ``uint8`` tensor of ``num_blocks * bytes_per_block`` bytes, laid
out *planar*: region ``k = stored_rank * num_planes + plane`` holds that plane of
every block, block after block, so a run of consecutive blocks of one plane is
one contiguous ``(run * tokens_per_block, row_elems)`` tensor. Copies between
engine slots and a run of blocks are then a single gather / scatter per plane
(``transfer.plan_rows``), with no intermediate buffer.

A *shared* pool is an anonymous memory file (``memfd``): engine processes on the
node receive a read-only descriptor of it over the agent's tier socket
(:mod:`.tier_fds`, named by :attr:`CpuTier.tier_id`) and map it to copy the
blocks of a claimed load themselves (docs/agent.md, "Engine-side loads"). Only
this process can write it: the file is sealed against new writes and size changes
(``F_SEAL_FUTURE_WRITE``), so even a descriptor an engine re-opens read-write
through ``/proc`` cannot change or shrink it. It has no name: its memory goes
with the last descriptor or mapping, so a killed agent leaves nothing behind. A
pinned pool (CUDA present) is never shared.

A shared pool's file holds one more page after the blocks: the *claim fence*, a
64-bit little-endian counter at the first page boundary after them
(:func:`fence_offset`, the handle's ``fence``; aligned, so each read or write of it
is one access).
The agent adds one to it, under its backend lock, whenever a claimed load ends
other than by the engine's own commit (lease over, flush, release, stage gone),
before any block of that claim can be reused. An engine that reads the same
value after its copy as the agent recorded when it made the claim knows that no
claim ended early meanwhile, so no block it read was rewritten
(docs/agent.md, "Engine-side loads").
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from node_agent.vocab.layout import KVLayout

log = logging.getLogger(__name__)

_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
"""Linux >= 5.1: no new write or writable mapping; this process's mapping stays writable."""
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL

FENCE_BYTES = 4096
"""The page after a shared pool's blocks that holds the claim fence."""


def fence_offset(nbytes: int) -> int:
    """Where the claim fence of a shared pool of ``nbytes`` bytes lies in its file:
    the first page boundary at or after the blocks."""
    return -(-nbytes // FENCE_BYTES) * FENCE_BYTES


def _fence_view(mapping: mmap.mmap, nbytes: int) -> npt.NDArray[np.uint64]:
    """The claim fence of a mapped pool file of ``nbytes`` bytes of blocks (writable
    only where the mapping is)."""
    return np.frombuffer(mapping, dtype="<u8", count=1, offset=fence_offset(nbytes))

_tiers: weakref.WeakValueDictionary[str, CpuTier] = weakref.WeakValueDictionary()
_tiers_lock = threading.Lock()


def read_only_fd(tier_id: str) -> int | None:
    """A new read-only descriptor of the shared tier ``tier_id`` of this process
    (the caller closes it), or None when there is no such open tier."""
    with _tiers_lock:
        tier = _tiers.get(tier_id)
    return None if tier is None else tier.read_only_fd()


def _shared_pool(nbytes: int) -> tuple[torch.Tensor, npt.NDArray[np.uint64], mmap.mmap,
                                       int] | None:
    """A zero-filled ``nbytes`` pool in a new memory file, its claim fence (the
    counter in the page after it) and the file's descriptor; None (logged) when the
    system cannot give one, so the tier stays in private memory."""
    try:
        fd = os.memfd_create("flexkv-cpu-tier", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError) as exc:
        log.warning("CPU tier kept in private memory: no memory file for engine-side loads",
                    extra={"error": str(exc)})
        return None
    try:
        # Reserves the pages now: a memory limit fails here, not later as a SIGBUS
        # on first touch.
        size = fence_offset(nbytes) + FENCE_BYTES
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        log.warning("CPU tier kept in private memory: its memory file does not fit",
                    extra={"bytes": nbytes, "error": str(exc)})
        return None
    try:
        # A read-only descriptor can be re-opened read-write through /proc: the
        # seals, not the descriptor's mode, keep engines from writing or shrinking it.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError as exc:
        mm.close()
        os.close(fd)
        log.warning("CPU tier kept in private memory: its memory file cannot be sealed "
                    "against engines' writes", extra={"error": str(exc),
                                                      "fix": "run on Linux 5.1 or later"})
        return None
    pool = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    return pool, _fence_view(mm, nbytes), mm, fd


class CpuTier:
    """``num_blocks`` blocks of ``layout.bytes_per_block`` bytes in host memory.

    ``shared``: keep the pool in a memory file engines may map read-only (when the
    pool is not pinned and the system gives one); :attr:`tier_id` then names it,
    else it is None. ``pool``: an existing buffer of the right size to view instead
    of allocating (an engine's read-only mapping, :func:`map_tier_fd`)."""

    def __init__(self, layout: KVLayout, num_blocks: int, pinned: bool,
                 shared: bool = False, *, pool: torch.Tensor | None = None) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        pin = bool(pinned and num_blocks and torch.cuda.is_available())
        self.pinned = pin
        self.tier_id: str | None = None
        self._fd: int | None = None
        self._fd_lock = threading.Lock()
        self._mapping: Any = None
        self._fence: npt.NDArray[np.uint64] | None = None
        nbytes = num_blocks * layout.bytes_per_block
        if pool is not None:
            if pool.dtype != torch.uint8 or pool.numel() != nbytes:
                raise ValueError(
                    f"a CPU tier of {num_blocks} blocks of this layout takes {nbytes} bytes, "
                    f"got a {pool.dtype} pool of {pool.numel()} elements; map the tier the "
                    "agent named, unchanged"
                )
            self.pool = pool
        else:
            got = _shared_pool(nbytes) if shared and not pin and nbytes else None
            if got is not None:
                self.pool, self._fence, self._mapping, self._fd = got
                self.tier_id = secrets.token_hex(16)
                with _tiers_lock:
                    _tiers[self.tier_id] = self
            else:
                self.pool = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self.pool.zero_()  # fault every page in now, not on the first transfer
        self._region_bytes = num_blocks * layout.segment_bytes
        self._rows = num_blocks * layout.tokens_per_block
        self.num_regions = layout.stored_ranks * layout.num_planes

    def region(self, stored_rank: int, plane: int) -> torch.Tensor:
        """Plane ``plane`` of ``stored_rank`` for every block: ``(num_blocks * tpb, row_elems)``."""
        k = stored_rank * self.layout.num_planes + plane
        raw = self.pool[k * self._region_bytes : (k + 1) * self._region_bytes]
        return raw.view(self.layout.dtype.torch_dtype).view(self._rows, self.layout.row_elems)

    def segments(self, k: int) -> torch.Tensor:
        """Region ``k`` as raw bytes, one row per block: ``(num_blocks, segment_bytes)``."""
        raw = self.pool[k * self._region_bytes : (k + 1) * self._region_bytes]
        return raw.view(self.num_blocks, self.layout.segment_bytes)

    def read_block(self, index: int) -> bytes:
        """The bytes of block ``index`` in region order (the SSD on-disk order)."""
        return b"".join(
            self.segments(k)[index].numpy().tobytes() for k in range(self.num_regions)
        )

    def handle(self) -> dict[str, Any] | None:
        """What an engine needs to ask for and map a shared pool (None: not shared)."""
        if self.tier_id is None:
            return None
        nbytes = int(self.pool.numel())
        return {"kind": "memfd", "id": self.tier_id, "blocks": self.num_blocks,
                "bytes": nbytes, "fence": fence_offset(nbytes)}

    def fence_value(self) -> int | None:
        """The claim fence's count (see the module docstring); None when the pool
        is not shared."""
        fence = self._fence
        return None if fence is None else int(fence[0])

    def bump_fence(self) -> None:
        """Count one claim that ended before its engine's commit. Call it under the
        lock that orders claims, before any block of that claim may be reused."""
        fence = self._fence
        if fence is not None:
            fence[0] += 1

    def read_only_fd(self) -> int | None:
        """A new read-only descriptor of the shared pool (the caller closes it): an
        engine given it can map the pool but never write it. None when not shared
        or closed. Linux (``/proc/self/fd``)."""
        with self._fd_lock:  # close() may not close the number while it is reopened
            fd = self._fd
            if fd is None:
                return None
            try:
                return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None

    def close(self) -> None:
        """Stop handing the shared pool out (engines' mappings and this process's
        views keep the memory until they go)."""
        tier_id, self.tier_id = self.tier_id, None
        if tier_id is not None:
            with _tiers_lock:
                _tiers.pop(tier_id, None)
        with self._fd_lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)


@dataclass
class MappedTier:
    """An engine's read-only view of an agent's shared CPU tier."""

    tier: CpuTier
    tier_id: str
    _mapping: mmap.mmap
    fence: npt.NDArray[np.uint64] | None = None
    """The agent's claim fence (read-only), None when its handle names none (an
    agent from before the fence)."""

    def fence_value(self) -> int | None:
        """The claim fence's count now; None without one."""
        fence = self.fence
        return None if fence is None else int(fence[0])

    def close(self) -> None:
        """Drop the mapping (views of it must be gone; one still exported keeps it)."""
        self.tier.pool = torch.empty(0, dtype=torch.uint8)
        self.fence = None
        with contextlib.suppress(BufferError):
            self._mapping.close()


def check_tier_handle(layout: KVLayout, handle: object) -> tuple[str, int, int]:
    """``(tier id, blocks, bytes)`` of a tier handle for ``layout``; ``ValueError``
    naming the bad field. A ``fence``, when present, must be :func:`fence_offset`
    of ``bytes`` (the counter in the page after the blocks)."""
    if not isinstance(handle, dict) or handle.get("kind") != "memfd":
        raise ValueError(f"tier handle {handle!r} is not a CPU tier handle "
                         "({'kind': 'memfd', 'id': ..., 'blocks': ..., 'bytes': ...})")
    tier_id, blocks, nbytes = handle.get("id"), handle.get("blocks"), handle.get("bytes")
    if not isinstance(tier_id, str) or not 0 < len(tier_id) <= 64 or not tier_id.isalnum():
        raise ValueError(f"tier handle id {tier_id!r} is not a tier id (up to 64 letters "
                         "and digits)")
    for key, value in (("blocks", blocks), ("bytes", nbytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"tier handle field {key!r} is {value!r}; it must be an int > 0")
    assert isinstance(blocks, int) and isinstance(nbytes, int)
    if blocks * layout.bytes_per_block != nbytes:
        raise ValueError(
            f"tier handle names {blocks} blocks in {nbytes} bytes, but a block of the "
            f"registered layout takes {layout.bytes_per_block}; register the same layout"
        )
    want = fence_offset(nbytes)
    fence = handle.get("fence", want)
    if fence != want or isinstance(fence, bool):
        raise ValueError(f"tier handle field 'fence' is {fence!r}; it must be {want}, the "
                         f"first page boundary after the handle's {nbytes} bytes (where the "
                         "claim fence lies)")
    return tier_id, blocks, nbytes


def map_tier_fd(layout: KVLayout, handle: object, fd: int) -> MappedTier:
    """Map the tier ``handle`` names from its descriptor ``fd`` (not closed here),
    read-only: a write through it faults, so an engine can never change the agent's
    blocks. Raises ``ValueError`` naming the bad field or size."""
    tier_id, blocks, nbytes = check_tier_handle(layout, handle)
    assert isinstance(handle, dict)
    fenced = "fence" in handle
    want = fence_offset(nbytes) + FENCE_BYTES if fenced else nbytes
    size = os.fstat(fd).st_size
    if size < want:
        raise ValueError(f"tier {tier_id} holds {size} bytes, its handle names {want}; "
                         "ask the agent again for its current tier")
    # Populated now: otherwise every first read of a page in a copy takes a page
    # fault, which halves the copy's rate.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, want, flags, mmap.PROT_READ)
    with warnings.catch_warnings():
        # A read-only buffer: torch warns that writes would be undefined; none are made.
        warnings.simplefilter("ignore", UserWarning)
        pool = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    fence = _fence_view(mm, nbytes) if fenced else None
    return MappedTier(CpuTier(layout, blocks, False, pool=pool), tier_id, mm, fence)

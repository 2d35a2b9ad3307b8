"""The CPU tier: one preallocated, optionally pinned or shared pool of blocks.

The pool is one ``uint8`` tensor of ``num_blocks * bytes_per_block`` bytes, laid
out *planar*: region ``k = stored_rank * num_planes + plane`` holds that plane of
every block, block after block, so a run of consecutive blocks of one plane is
one contiguous ``(run * tokens_per_block, row_elems)`` tensor. Copies between
engine slots and a run of blocks are then a single gather / scatter per plane
(``transfer.plan_rows``), with no intermediate buffer.

A *shared* pool lives in a POSIX shared-memory segment (a file in ``/dev/shm``)
that engine processes on the node may map read-only (:func:`map_shared_tier`) to
copy the blocks of a claimed load themselves (docs/agent.md, "Engine-side
loads"). Only this process writes it. A pinned pool (CUDA present) is never
shared. The segment is unlinked by :meth:`CpuTier.close`; segments a killed agent
left behind are removed by :func:`sweep_segments` when the next one starts.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import logging
import mmap
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from node_agent.vocab.layout import KVLayout

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory segments are files (Linux)."""
_SEGMENT_PREFIX = "flexkv-tier-"
_counter = itertools.count()
_counter_lock = threading.Lock()


def segment_prefix(engine_socket: str) -> str:
    """The name prefix of every shared tier an agent on ``engine_socket`` creates:
    one agent per socket path, so its next incarnation knows which segments are its
    own leftovers (:func:`sweep_segments`)."""
    digest = hashlib.blake2b(os.path.abspath(engine_socket).encode(), digest_size=6)
    return f"{_SEGMENT_PREFIX}{digest.hexdigest()}-"


def next_segment_name(prefix: str) -> str:
    """A fresh segment name under ``prefix`` (unique within this process)."""
    with _counter_lock:
        return f"{prefix}{os.getpid()}-{next(_counter)}"


def sweep_segments(prefix: str, shm_dir: str = SHM_DIR) -> int:
    """Unlink every segment named ``prefix*``: the tiers of an earlier agent on the
    same engine socket that did not close (killed). Returns how many; an engine
    still mapping one keeps its memory until it unmaps, nothing else can reach it."""
    removed = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, name))
                removed += 1
    if removed:
        log.warning("Removed CPU tier segments a previous agent left behind",
                    extra={"segments": removed, "prefix": prefix})
    return removed


def _shared_pool(name: str, nbytes: int, shm_dir: str) -> tuple[torch.Tensor, mmap.mmap] | None:
    """A zero-filled ``nbytes`` pool in a new segment ``name``; None (logged) when
    ``/dev/shm`` cannot hold it, so the tier falls back to private memory."""
    path = os.path.join(shm_dir, name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a leftover of this name is a dead agent's
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        log.warning("CPU tier kept in private memory: cannot create its shared segment",
                    extra={"segment": path, "error": str(exc)})
        return None
    try:
        # Reserves the tmpfs pages now: a full /dev/shm fails here, not later as a
        # SIGBUS on first touch.
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        level = logging.WARNING if exc.errno in (errno.ENOSPC, errno.ENOMEM) else logging.ERROR
        log.log(level, "CPU tier kept in private memory: its shared segment does not fit",
                extra={"segment": path, "bytes": nbytes, "error": str(exc),
                       "fix": f"give {shm_dir} at least the CPU tier's size"})
        return None
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8), mm


class CpuTier:
    """``num_blocks`` blocks of ``layout.bytes_per_block`` bytes in host memory.

    ``shared_name``: keep the pool in that shared-memory segment (when it fits and
    the pool is not pinned); :attr:`shared_name` is then the segment's name, else
    None. ``pool``: an existing buffer of the right size to view instead of
    allocating (an engine's read-only mapping, :func:`map_shared_tier`)."""

    def __init__(self, layout: KVLayout, num_blocks: int, pinned: bool,
                 shared_name: str | None = None, *, pool: torch.Tensor | None = None,
                 shm_dir: str = SHM_DIR) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        pin = bool(pinned and num_blocks and torch.cuda.is_available())
        self.pinned = pin
        self.shared_name: str | None = None
        self._path: str | None = None
        self._mapping: Any = None
        nbytes = num_blocks * layout.bytes_per_block
        if pool is not None:
            if pool.dtype != torch.uint8 or pool.numel() != nbytes:
                raise ValueError(
                    f"a CPU tier of {num_blocks} blocks of this layout takes {nbytes} bytes, "
                    f"got a {pool.dtype} pool of {pool.numel()} elements; map the segment the "
                    "agent named in its register reply, unchanged"
                )
            self.pool = pool
        else:
            shared = (_shared_pool(shared_name, nbytes, shm_dir)
                      if shared_name and not pin and nbytes else None)
            if shared is not None:
                self.pool, self._mapping = shared
                self.shared_name = shared_name
                self._path = os.path.join(shm_dir, str(shared_name))
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
        """What an engine needs to map a shared pool (None when not shared)."""
        if self.shared_name is None:
            return None
        return {"kind": "shm", "name": self.shared_name, "blocks": self.num_blocks,
                "bytes": int(self.pool.numel())}

    def close(self) -> None:
        """Unlink a shared pool's segment (the memory goes with the last mapping)."""
        path, self._path = self._path, None
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@dataclass
class MappedTier:
    """An engine's read-only view of an agent's shared CPU tier."""

    tier: CpuTier
    name: str
    _mapping: mmap.mmap

    def close(self) -> None:
        """Drop the mapping (views of it must be gone; one still exported keeps it)."""
        self.tier.pool = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):
            self._mapping.close()


def map_shared_tier(layout: KVLayout, handle: object,
                    shm_dir: str = SHM_DIR) -> MappedTier:
    """Map the tier an agent's register reply named, read-only: a write through it
    faults, so an engine can never change the agent's blocks. Raises ``ValueError``
    naming the bad field, or ``OSError`` when the segment cannot be opened."""
    if not isinstance(handle, dict) or handle.get("kind") != "shm":
        raise ValueError(f"tier handle {handle!r} is not a shared-memory handle "
                         "({'kind': 'shm', 'name': ..., 'blocks': ..., 'bytes': ...})")
    name, blocks, nbytes = handle.get("name"), handle.get("blocks"), handle.get("bytes")
    if not isinstance(name, str) or not name.startswith(_SEGMENT_PREFIX) or "/" in name:
        raise ValueError(f"tier handle name {name!r} is not an agent's tier segment "
                         f"({_SEGMENT_PREFIX}...)")
    for key, value in (("blocks", blocks), ("bytes", nbytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"tier handle field {key!r} is {value!r}; it must be an int > 0")
    assert isinstance(blocks, int) and isinstance(nbytes, int)
    if blocks * layout.bytes_per_block != nbytes:
        raise ValueError(
            f"tier handle names {blocks} blocks in {nbytes} bytes, but a block of the "
            f"registered layout takes {layout.bytes_per_block}; register the same layout"
        )
    fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"tier segment {name} holds {size} bytes, the handle names "
                             f"{nbytes}; register again to get the agent's current tier")
        # Populated now: otherwise every first read of a page in a copy takes a
        # page fault, which halves the copy's rate.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # A read-only buffer: torch warns that writes would be undefined; none are made.
        warnings.simplefilter("ignore", UserWarning)
        pool = torch.frombuffer(mm, dtype=torch.uint8)
    return MappedTier(CpuTier(layout, blocks, False, pool=pool), name, mm)

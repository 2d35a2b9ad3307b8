"""Copies between registered engine buffers and tier blocks, batched per task.

Every copy is a handful of torch index ops per plane (``index_select`` with
``out=`` into a run of CPU blocks, ``index_copy_`` out of one), never a Python
loop per token. Runs of consecutive blocks are copied in place; a task whose
blocks are scattered over more than :data:`MAX_RUNS` runs is copied through one
gathered row index instead.

Copy unit: when every block's slots are one aligned engine page (``tpb``
consecutive slots starting at a multiple of ``tpb``, as SGLang allocates with
``page_size == tokens_per_block``), planes are indexed by page - rows of
``tpb`` tokens - instead of by token, which makes every row copy 16x longer.
Otherwise they are indexed by token. Both give the same bytes. Paged layouts
(vLLM's ``layer_block_head_token_kv``) are copied by page only: their slot
mappings must be whole, aligned pages.

The same calls work for CUDA engine buffers (the gather happens on the device,
then one copy crosses to or from the host) and for CPU tensors; a CUDA device is
synchronised before a copy reports done.

Stopping: ``store`` and ``load`` take an optional ``abort`` event and check it
before every run / plane / SSD block copy; once it is set they synchronise the
devices (no queued write is still in flight) and raise :class:`CopyAborted`. A
copy therefore stops within one run or plane copy of the request; the bytes it
already wrote (engine slots for a load, tier blocks for a store) are undefined.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from node_agent.backend.cpu_tier import CpuTier
from node_agent.backend.layout import KVLayout, RegisteredBuffers
from node_agent.backend.replication import BlockLocation, Tier
from node_agent.backend.ssd_tier import SsdTier

#: Above this many runs of consecutive blocks a copy uses one gathered index.
MAX_RUNS = 8
#: SSD loads go through a per-thread staging buffer of about this many bytes.
STAGING_BYTES = 64 * 1024 * 1024


class CopyAborted(RuntimeError):
    """A copy stopped early because its abort event was set; what it wrote is undefined."""


def block_runs(positions: Sequence[int], blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split parallel (position, block) lists into runs ``(first_pos, first_block, length)``
    where both advance by one."""
    runs: list[tuple[int, int, int]] = []
    for pos, blk in zip(positions, blocks, strict=True):
        if runs:
            p0, b0, n = runs[-1]
            if pos == p0 + n and blk == b0 + n:
                runs[-1] = (p0, b0, n + 1)
                continue
        runs.append((pos, blk, 1))
    return runs


def unit_rows(blocks: Sequence[int], units: int) -> torch.Tensor:
    """Row indices of every unit of ``blocks`` (or block positions), ``units`` per block."""
    base = torch.as_tensor(list(blocks), dtype=torch.int64)
    if units == 1:
        return base
    return (base.unsqueeze(1) * units + torch.arange(units, dtype=torch.int64)).reshape(-1)


def page_index(slots: torch.Tensor, tpb: int) -> torch.Tensor | None:
    """Per-block engine page ids when each block's slots are one aligned page, else None."""
    if tpb == 1 or not len(slots):
        return None
    per_block = slots.view(-1, tpb)
    first = per_block[:, :1]
    if bool((first % tpb != 0).any()):
        return None
    if not bool((per_block - first == torch.arange(tpb, dtype=slots.dtype)).all()):
        return None
    return (first.reshape(-1) // tpb).contiguous()


def _widest_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D, unit stride in dim 1) viewed with the widest element that tiles its rows.

    Index kernels copy element by element; 16-byte elements make a row copy
    close to ``memcpy`` speed. Only the bytes are reinterpreted, never the values,
    so copies stay bit-exact.
    """
    row_bytes = t.shape[1] * t.element_size()
    for wide in (torch.complex128, torch.int64, torch.int32):
        size = wide.itemsize
        if (row_bytes % size == 0 and (t.stride(0) * t.element_size()) % size == 0
                and (t.storage_offset() * t.element_size()) % size == 0
                and t.data_ptr() % size == 0):
            return t.view(wide)
    return t


def _gather_into(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    if src.device == out.device:
        torch.index_select(src, 0, index, out=out)
    else:
        out.copy_(src.index_select(0, index), non_blocking=True)


def _synchronize(devices: set[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


class _Units:
    """One slot mapping prepared for a device: token slots, and page ids when aligned."""

    def __init__(self, slots: torch.Tensor, pages: torch.Tensor | None, tpb: int,
                 device: torch.device) -> None:
        self.tpb = tpb
        self.tokens = slots.to(device)
        self.pages = pages.to(device) if pages is not None else None

    def pick(self, plane: torch.Tensor, paged: bool = False,
             ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(plane as rows of one unit, unit index, units per block)`` for ``plane``
        (``paged``: its rows are pages already)."""
        if paged:
            assert self.pages is not None  # checked in BlockCopier._units
            return plane, self.pages, 1
        if self.pages is not None and plane.stride(0) == plane.shape[1]:
            n = plane.shape[0] // self.tpb
            return plane[: n * self.tpb].view(n, -1), self.pages, 1
        return plane, self.tokens, self.tpb


class _Subsets:
    """Unit indices restricted to some block positions, computed once per index."""

    def __init__(self, positions: Sequence[int]) -> None:
        self.positions = positions
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    def of(self, index: torch.Tensor, units: int) -> torch.Tensor:
        key = (id(index), units)  # the indexes live as long as this object
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = index[unit_rows(self.positions, units).to(index.device)]
        return got


class BlockCopier:
    """Moves KV between engine buffers, the CPU tier and the SSD tier of one stage."""

    def __init__(self, layout: KVLayout, cpu: CpuTier, ssd: SsdTier | None) -> None:
        self.layout = layout
        self.cpu = cpu
        self.ssd = ssd
        self._local = threading.local()
        #: Called with the copy's abort event (or None) at every checkpoint, before
        #: the event is checked: a seam for tests that need a copy paused mid-way.
        self.checkpoint_hook: Callable[[threading.Event | None], None] | None = None

    def _checkpoint(self, abort: threading.Event | None) -> None:
        """Raise :class:`CopyAborted` when ``abort`` is set (after the hook ran)."""
        hook = self.checkpoint_hook
        if hook is not None:
            hook(abort)
        if abort is not None and abort.is_set():
            raise CopyAborted("copy stopped on request; the bytes it wrote are undefined")

    def _units(self, buffers: Mapping[int, RegisteredBuffers], slots: torch.Tensor,
               ) -> dict[torch.device, _Units]:
        tpb = self.layout.tokens_per_block
        pages = page_index(slots, tpb)
        if pages is None and self.layout.name.paged and len(slots):
            raise ValueError(
                f"layout {self.layout.name.value} is copied by whole pages, but the slots do "
                f"not form whole, aligned pages of {tpb} (slot = block * {tpb} + offset); "
                "pass every slot of each block, in order"
            )
        return {d: _Units(slots, pages, tpb, d) for d in {b.device for b in buffers.values()}}

    def _region(self, stored_rank: int, plane: int, dtype: torch.dtype, units: int,
                ) -> torch.Tensor:
        """The CPU region of ``plane`` as rows of one unit (``units`` rows per block)."""
        region = self.cpu.region(stored_rank, plane).view(dtype)
        return region.view(self.cpu.num_blocks * units, -1)

    def store(
        self, buffers: Mapping[int, RegisteredBuffers], blocks: Sequence[int],
        slots: torch.Tensor, abort: threading.Event | None = None,
    ) -> None:
        """Copy the tokens at ``slots`` (token order) into CPU ``blocks`` (block order).

        Raises :class:`CopyAborted` (blocks undefined) once ``abort`` is set."""
        lay = self.layout
        runs = block_runs(range(len(blocks)), blocks)
        gathered = len(runs) > MAX_RUNS
        prepared = self._units(buffers, slots)
        rows: dict[int, torch.Tensor] = {}
        try:
            for r in range(lay.stored_ranks):
                buf = buffers[r]
                units = prepared[buf.device]
                for p in range(lay.num_planes):
                    src, idx, u = units.pick(_widest_view(buf.planes[p]), buf.paged)
                    region = self._region(r, p, src.dtype, u)
                    if not gathered:
                        for pos, b0, n in runs:
                            self._checkpoint(abort)
                            _gather_into(src, idx[pos * u : (pos + n) * u],
                                         region[b0 * u : (b0 + n) * u])
                    else:
                        self._checkpoint(abort)
                        if u not in rows:
                            rows[u] = unit_rows(blocks, u)
                        region.index_copy_(0, rows[u],
                                           src.index_select(0, idx).to(region.device))
        finally:
            _synchronize(set(prepared))

    def load(
        self,
        buffers: Mapping[int, RegisteredBuffers],
        locations: Sequence[BlockLocation],
        slots: torch.Tensor,
        abort: threading.Event | None = None,
    ) -> None:
        """Copy ``locations`` (token order, any tier) into the engine slots ``slots``
        of every registered rank.

        Raises :class:`CopyAborted` (slots undefined) once ``abort`` is set; every
        device is synchronised first, so nothing writes the slots afterwards."""
        cpu_pos = [i for i, loc in enumerate(locations) if loc.tier is Tier.CPU]
        ssd_pos = [i for i, loc in enumerate(locations) if loc.tier is Tier.SSD]
        prepared = self._units(buffers, slots)
        try:
            if cpu_pos:
                self._load_cpu(buffers, cpu_pos, [locations[i].index for i in cpu_pos],
                               prepared, abort)
            ssd_blk = [locations[i].index for i in ssd_pos]
            if ssd_pos and not self._load_ssd_direct(buffers, ssd_pos, ssd_blk, prepared,
                                                     abort):
                step = max(1, STAGING_BYTES // self.layout.bytes_per_block)
                for c in range(0, len(ssd_pos), step):
                    self._load_ssd(buffers, ssd_pos[c : c + step], ssd_blk[c : c + step],
                                   prepared, abort)
        finally:
            _synchronize(set(prepared))

    def _load_cpu(
        self,
        buffers: Mapping[int, RegisteredBuffers],
        positions: Sequence[int],
        blocks: Sequence[int],
        prepared: dict[torch.device, _Units],
        abort: threading.Event | None,
    ) -> None:
        lay = self.layout
        runs = block_runs(positions, blocks)
        gathered = len(runs) > MAX_RUNS
        rows: dict[int, torch.Tensor] = {}
        subsets = _Subsets(positions)
        for rank, buf in buffers.items():
            sr = 0 if lay.is_mla else rank
            units = prepared[buf.device]
            for p in range(lay.num_planes):
                dst, idx, u = units.pick(_widest_view(buf.planes[p]), buf.paged)
                region = self._region(sr, p, dst.dtype, u)
                if not gathered:
                    for pos, b0, n in runs:
                        self._checkpoint(abort)
                        dst.index_copy_(0, idx[pos * u : (pos + n) * u],
                                        region[b0 * u : (b0 + n) * u].to(dst.device))
                else:
                    self._checkpoint(abort)
                    if u not in rows:
                        rows[u] = unit_rows(blocks, u)
                    dst.index_copy_(0, subsets.of(idx, u),
                                    region.index_select(0, rows[u]).to(dst.device))

    def _load_ssd_direct(
        self,
        buffers: Mapping[int, RegisteredBuffers],
        positions: Sequence[int],
        blocks: Sequence[int],
        prepared: dict[torch.device, _Units],
        abort: threading.Event | None,
    ) -> bool:
        """Read SSD ``blocks`` straight into the engine's pages, one ``preadv`` per block.

        Possible when every block's slots are one aligned engine page (a block's
        on-disk segment for a plane is then exactly that page of the plane) and
        every buffer is a CPU tensor with contiguous rows; returns False otherwise
        (and for MLA with several ranks, which need one read copied to each).
        """
        lay = self.layout
        if self.ssd is None or (lay.is_mla and len(buffers) > 1):
            return False
        if any(b.device.type != "cpu" for b in buffers.values()):
            return False
        units = prepared.get(torch.device("cpu"))
        if units is None or units.pages is None:
            return False
        tpb = lay.tokens_per_block
        pages = []  # one (num_pages, segment_bytes) byte view per region, in disk order
        for sr in range(lay.stored_ranks):
            for plane in buffers[sr].planes:
                if buffers[sr].paged:
                    pages.append(plane.view(torch.uint8).numpy())
                    continue
                if plane.stride(0) != plane.shape[1]:
                    return False
                n = plane.shape[0] // tpb
                pages.append(plane[: n * tpb].view(torch.uint8).view(n, -1).numpy())
        page_of = units.pages.tolist()
        for pos, b in zip(positions, blocks, strict=True):
            g = page_of[pos]
            self._checkpoint(abort)
            self.ssd.read(b, [arr[g].data for arr in pages])
        return True

    def _load_ssd(
        self,
        buffers: Mapping[int, RegisteredBuffers],
        positions: Sequence[int],
        blocks: Sequence[int],
        prepared: dict[torch.device, _Units],
        abort: threading.Event | None,
    ) -> None:
        """Read ``blocks`` into this thread's staging buffer, then scatter them."""
        if self.ssd is None:
            raise RuntimeError("a plan names SSD blocks but this stage has no SSD tier")
        lay = self.layout
        staging = self._staging(len(blocks))
        arr = staging.numpy()
        for j, b in enumerate(blocks):
            self.ssd.read(b, [arr[k, j].data for k in range(self.cpu.num_regions)])
        subsets = _Subsets(positions)
        for rank, buf in buffers.items():
            sr = 0 if lay.is_mla else rank
            units = prepared[buf.device]
            for p in range(lay.num_planes):
                dst, idx, u = units.pick(_widest_view(buf.planes[p]), buf.paged)
                k = sr * lay.num_planes + p
                data = staging[k, : len(blocks)].view(dst.dtype).view(len(blocks) * u, -1)
                self._checkpoint(abort)
                dst.index_copy_(0, subsets.of(idx, u), data.to(dst.device))

    def _staging(self, blocks: int) -> torch.Tensor:
        """This worker thread's reusable staging tensor ``(regions, >= blocks, segment_bytes)``
        (reused so SSD loads do not fault fresh pages in every time)."""
        cur: torch.Tensor | None = getattr(self._local, "staging", None)
        if cur is None or cur.shape[1] < blocks:
            cap = max(1, STAGING_BYTES // self.layout.bytes_per_block)
            cur = torch.empty(self.cpu.num_regions, max(blocks, min(cap, blocks * 2)),
                              self.layout.segment_bytes, dtype=torch.uint8)
            self._local.staging = cur
        return cur

    def move(self, src: BlockLocation, dst: BlockLocation) -> None:
        """Copy one block's bytes from ``src`` to ``dst`` (any tiers)."""
        regions = range(self.cpu.num_regions)
        if src.tier is Tier.CPU and dst.tier is Tier.CPU:
            for k in regions:
                seg = self.cpu.segments(k)
                seg[dst.index].copy_(seg[src.index])
            return
        if self.ssd is None:
            raise RuntimeError(f"move {src} -> {dst} names the SSD tier but this stage has none")
        if src.tier is Tier.CPU:
            self.ssd.write(dst.index, [self.cpu.segments(k)[src.index].numpy().data
                                       for k in regions])
        elif dst.tier is Tier.CPU:
            self.ssd.read(src.index, [self.cpu.segments(k)[dst.index].numpy().data
                                      for k in regions])
        else:
            self.ssd.write(dst.index, [memoryview(self.ssd.read_block(src.index))])

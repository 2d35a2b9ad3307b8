"""Copies between registered engine buffers and tier blocks, batched per task.

Every copy is a handful of torch index ops per plane (``index_select`` with
``out=`` into a run of CPU blocks, ``index_copy_`` out of one), never a Python
loop per token. Runs of consecutive blocks are copied in place; a task whose
blocks are scattered over more than :data:`MAX_RUNS` runs is copied through one
gathered row index instead. The same calls work for CUDA engine buffers (the
gather happens on the device, then one copy crosses to or from the host) and
for CPU tensors; a CUDA device is synchronised before a copy reports done.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from node_agent.backend.cpu_tier import CpuTier
from node_agent.backend.layout import KVLayout, RegisteredBuffers
from node_agent.backend.replication import BlockLocation, Tier
from node_agent.backend.ssd_tier import SsdTier

#: Above this many runs of consecutive blocks a copy uses one gathered index.
MAX_RUNS = 8
#: SSD loads go through a per-thread staging buffer of about this many bytes.
STAGING_BYTES = 64 * 1024 * 1024


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


def _token_rows(units: Sequence[int], tpb: int) -> torch.Tensor:
    """Row indices of every token of ``units`` (blocks or block positions)."""
    base = torch.as_tensor(list(units), dtype=torch.int64).unsqueeze(1) * tpb
    return (base + torch.arange(tpb, dtype=torch.int64)).reshape(-1)


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


class BlockCopier:
    """Moves KV between engine buffers, the CPU tier and the SSD tier of one stage."""

    def __init__(self, layout: KVLayout, cpu: CpuTier, ssd: SsdTier | None) -> None:
        self.layout = layout
        self.cpu = cpu
        self.ssd = ssd
        self._local = threading.local()

    def store(
        self, buffers: Mapping[int, RegisteredBuffers], blocks: Sequence[int], slots: torch.Tensor
    ) -> None:
        """Copy the tokens at ``slots`` (token order) into CPU ``blocks`` (block order)."""
        lay, tpb = self.layout, self.layout.tokens_per_block
        runs = block_runs(range(len(blocks)), blocks)
        rows = None if len(runs) <= MAX_RUNS else _token_rows(blocks, tpb)
        devices: set[torch.device] = set()
        for r in range(lay.stored_ranks):
            buf = buffers[r]
            devices.add(buf.device)
            s = slots.to(buf.device)
            for p in range(lay.num_planes):
                src = _widest_view(buf.planes[p])
                region = self.cpu.region(r, p).view(src.dtype)
                if rows is None:
                    for pos, b0, n in runs:
                        _gather_into(src, s[pos * tpb : (pos + n) * tpb],
                                     region[b0 * tpb : (b0 + n) * tpb])
                else:
                    region.index_copy_(0, rows, src.index_select(0, s).to(region.device))
        _synchronize(devices)

    def load(
        self,
        buffers: Mapping[int, RegisteredBuffers],
        locations: Sequence[BlockLocation],
        slots: torch.Tensor,
    ) -> None:
        """Copy ``locations`` (token order, any tier) into the engine slots ``slots``
        of every registered rank."""
        cpu_pos = [i for i, loc in enumerate(locations) if loc.tier is Tier.CPU]
        ssd_pos = [i for i, loc in enumerate(locations) if loc.tier is Tier.SSD]
        slots_on = {d: slots.to(d) for d in {b.device for b in buffers.values()}}
        if cpu_pos:
            self._load_cpu(buffers, cpu_pos, [locations[i].index for i in cpu_pos], slots_on)
        step = max(1, STAGING_BYTES // self.layout.bytes_per_block)
        for c in range(0, len(ssd_pos), step):
            chunk = ssd_pos[c : c + step]
            self._load_ssd(buffers, chunk, [locations[i].index for i in chunk], slots_on)
        _synchronize(set(slots_on))

    def _load_cpu(
        self,
        buffers: Mapping[int, RegisteredBuffers],
        positions: Sequence[int],
        blocks: Sequence[int],
        slots_on: dict[torch.device, torch.Tensor],
    ) -> None:
        lay, tpb = self.layout, self.layout.tokens_per_block
        runs = block_runs(positions, blocks)
        gathered = len(runs) > MAX_RUNS
        rows = _token_rows(blocks, tpb) if gathered else None
        tok = _token_rows(positions, tpb) if gathered else None
        for rank, buf in buffers.items():
            sr = 0 if lay.is_mla else rank
            s = slots_on[buf.device]
            s_tok = s[tok.to(s.device)] if tok is not None else None
            for p in range(lay.num_planes):
                dst = _widest_view(buf.planes[p])
                region = self.cpu.region(sr, p).view(dst.dtype)
                if rows is None or s_tok is None:
                    for pos, b0, n in runs:
                        dst.index_copy_(0, s[pos * tpb : (pos + n) * tpb],
                                        region[b0 * tpb : (b0 + n) * tpb].to(dst.device))
                else:
                    dst.index_copy_(0, s_tok, region.index_select(0, rows).to(dst.device))

    def _load_ssd(
        self,
        buffers: Mapping[int, RegisteredBuffers],
        positions: Sequence[int],
        blocks: Sequence[int],
        slots_on: dict[torch.device, torch.Tensor],
    ) -> None:
        """Read ``blocks`` into this thread's staging buffer, then scatter them."""
        if self.ssd is None:
            raise RuntimeError("a plan names SSD blocks but this stage has no SSD tier")
        lay = self.layout
        staging = self._staging(len(blocks))
        arr = staging.numpy()
        for j, b in enumerate(blocks):
            self.ssd.read(b, [arr[k, j].data for k in range(self.cpu.num_regions)])
        tok = _token_rows(positions, lay.tokens_per_block)
        for rank, buf in buffers.items():
            sr = 0 if lay.is_mla else rank
            s = slots_on[buf.device]
            s_tok = s[tok.to(s.device)]
            for p in range(lay.num_planes):
                dst = _widest_view(buf.planes[p])
                k = sr * lay.num_planes + p
                data = staging[k, : len(blocks)].view(dst.dtype).view(-1, dst.shape[1])
                dst.index_copy_(0, s_tok, data.to(dst.device))

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

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

from collections.abc import Mapping, Sequence

import torch

from node_agent.backend.cpu_tier import CpuTier
from node_agent.backend.layout import KVLayout, RegisteredBuffers
from node_agent.backend.replication import BlockLocation, Tier
from node_agent.backend.ssd_tier import SsdTier

#: Above this many runs of consecutive blocks a copy uses one gathered index.
MAX_RUNS = 8


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
                src, region = buf.planes[p], self.cpu.region(r, p)
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
        lay, tpb = self.layout, self.layout.tokens_per_block
        cpu_pos = [i for i, loc in enumerate(locations) if loc.tier is Tier.CPU]
        cpu_blk = [locations[i].index for i in cpu_pos]
        ssd_pos = [i for i, loc in enumerate(locations) if loc.tier is Tier.SSD]
        runs = block_runs(cpu_pos, cpu_blk)
        gathered = len(runs) > MAX_RUNS
        cpu_rows = _token_rows(cpu_blk, tpb) if gathered else None
        cpu_tok = _token_rows(cpu_pos, tpb) if gathered else None
        staging = self._read_ssd([locations[i].index for i in ssd_pos]) if ssd_pos else None
        ssd_tok = _token_rows(ssd_pos, tpb) if ssd_pos else None
        devices: set[torch.device] = set()
        for rank, buf in buffers.items():
            sr = 0 if lay.is_mla else rank
            devices.add(buf.device)
            s = slots.to(buf.device)
            for p in range(lay.num_planes):
                dst, region = buf.planes[p], self.cpu.region(sr, p)
                if cpu_rows is None:
                    for pos, b0, n in runs:
                        dst.index_copy_(0, s[pos * tpb : (pos + n) * tpb],
                                        region[b0 * tpb : (b0 + n) * tpb].to(dst.device))
                elif cpu_tok is not None:
                    dst.index_copy_(0, s[cpu_tok.to(s.device)],
                                    region.index_select(0, cpu_rows).to(dst.device))
                if staging is not None and ssd_tok is not None:
                    k = sr * lay.num_planes + p
                    data = staging[k].view(lay.dtype.torch_dtype).view(-1, lay.row_elems)
                    dst.index_copy_(0, s[ssd_tok.to(s.device)], data.to(dst.device))
        _synchronize(devices)

    def _read_ssd(self, blocks: Sequence[int]) -> torch.Tensor:
        """Read SSD ``blocks`` into a staging tensor ``(regions, len(blocks), segment_bytes)``."""
        if self.ssd is None:
            raise RuntimeError("a plan names SSD blocks but this stage has no SSD tier")
        staging = torch.empty(self.cpu.num_regions, len(blocks), self.layout.segment_bytes,
                              dtype=torch.uint8)
        arr = staging.numpy()
        for j, b in enumerate(blocks):
            self.ssd.read(b, [arr[k, j].data for k in range(self.cpu.num_regions)])
        return staging

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

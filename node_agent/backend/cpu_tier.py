"""The CPU tier: one preallocated, optionally pinned pool of blocks.

The pool is one ``uint8`` tensor of ``num_blocks * bytes_per_block`` bytes, laid
out *planar*: region ``k = stored_rank * num_planes + plane`` holds that plane of
every block, block after block, so a run of consecutive blocks of one plane is
one contiguous ``(run * tokens_per_block, row_elems)`` tensor. Copies between
engine slots and a run of blocks are then a single gather / scatter per plane
(``transfer.plan_rows``), with no intermediate buffer.
"""

from __future__ import annotations

import torch

from node_agent.vocab.layout import KVLayout


class CpuTier:
    """``num_blocks`` blocks of ``layout.bytes_per_block`` bytes in host memory."""

    def __init__(self, layout: KVLayout, num_blocks: int, pinned: bool) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        pin = bool(pinned and num_blocks and torch.cuda.is_available())
        self.pinned = pin
        self.pool = torch.empty(num_blocks * layout.bytes_per_block, dtype=torch.uint8,
                                pin_memory=pin)
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

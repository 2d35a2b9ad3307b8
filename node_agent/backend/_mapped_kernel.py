"""The Triton kernel behind :mod:`.mapped_rows` (imported only by it, lazily).

Importing this module imports ``triton``, which every CUDA build of torch on
Linux installs; hosts without it never import this module.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def move_rows_kernel(dst, src, dst_rows, src_rows, dst_start, src_start,
                     dst_stride, src_stride, row_bytes,
                     DST_INDEXED: tl.constexpr, SRC_INDEXED: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Program ``(r, c)`` copies bytes ``[c * BLOCK, (c + 1) * BLOCK)`` of row pair
    ``r``: destination row ``dst_rows[r]`` (or ``dst_start + r``) of ``dst`` from
    source row ``src_rows[r]`` (or ``src_start + r``) of ``src``. Both are byte
    pointers; strides are in bytes; offsets are computed in 64 bits."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    d = tl.load(dst_rows + r) if DST_INDEXED else dst_start + r
    s = tl.load(src_rows + r) if SRC_INDEXED else src_start + r
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_bytes
    v = tl.load(src + s * src_stride + offs, mask=mask)
    tl.store(dst + d * dst_stride + offs, v, mask=mask)

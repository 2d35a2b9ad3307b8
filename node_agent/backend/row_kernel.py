"""The CPU row scatter kernel: rows written to scattered destination rows between CPU tensors.

A *row* is one unit of a plane (one token, or one page): a dense run of bytes.
:func:`scatter` and :func:`gather_scatter` move rows between two C-contiguous
CPU tensors viewed as numpy arrays with one opaque ``void`` element per row, so
each row is one ``memmove`` whatever the dtype (torch's ``index_copy_`` copies
element by element), on the calling thread only (no torch intra-op threads:
the copy lanes share the cores) and with the GIL released. Gathers into a
contiguous destination and slice copies stay with torch (``index_select`` /
``copy_``), which measured as fast or faster on the development machine.

Contract: indices are int64 row numbers; the caller bounds them (``RowOp``
records each index's range once and checks it against the tensors before any
byte moves), because the kernels clip instead of raising (numpy's raising
mode first copies the whole output, doubling the bytes moved). A move between
two scattered sides goes through this thread's staging buffer, grown on demand
up to ``STAGING_MAX_BYTES`` (larger moves go in pieces) and reused by later
calls, so no call allocates row memory and no thread keeps more than that.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import torch

Index = npt.NDArray[np.int64]

_local = threading.local()


def row_array(t: torch.Tensor) -> npt.NDArray[np.void] | None:
    """``t`` (2-D CPU tensor, rows first) as a 1-D numpy array with one ``void``
    element per row, sharing its memory; None when ``t`` is not C-contiguous rows
    (then the caller copies with torch ops)."""
    if t.device.type != "cpu" or t.dim() != 2 or t.shape[1] == 0:
        return None
    if t.stride(1) != 1 or (t.shape[0] > 1 and t.stride(0) != t.shape[1]):
        return None
    raw = t.detach().view(torch.uint8).numpy()
    return raw.view(np.dtype((np.void, raw.shape[1]))).reshape(-1)


def scatter(dst: npt.NDArray[np.void], index: Index, src: npt.NDArray[np.void],
            s: int) -> None:
    """``dst[index] = src[s:s+len(index)]`` (``index`` must not repeat a row)."""
    np.put(dst, index, src[s:s + len(index)], mode="clip")


#: The most staging bytes a thread keeps: a larger move goes through it in pieces,
#: so no thread holds more than this outside the tiers' budgets.
STAGING_MAX_BYTES = 16 << 20


def gather_scatter(dst: npt.NDArray[np.void], dst_index: Index, src: npt.NDArray[np.void],
                   src_index: Index) -> None:
    """``dst[dst_index] = src[src_index]`` through this thread's staging buffer, in
    pieces of at most :data:`STAGING_MAX_BYTES` (a row larger than that is one piece)."""
    n = len(src_index)
    row = src.dtype.itemsize
    step = max(1, STAGING_MAX_BYTES // row)
    stage = _staging(min(n, step) * row).view(src.dtype)
    for a in range(0, n, step):
        b = min(a + step, n)
        part = stage[:b - a]
        np.take(src, src_index[a:b], out=part, mode="clip")
        np.put(dst, dst_index[a:b], part, mode="clip")


def _staging(nbytes: int) -> npt.NDArray[np.uint8]:
    """This thread's staging bytes, at least ``nbytes``: grown to the largest request
    so far (one piece of one plane's rows, see :func:`gather_scatter`), then reused."""
    cur: npt.NDArray[np.uint8] | None = getattr(_local, "stage", None)
    if cur is None or len(cur) < nbytes:
        cur = np.empty(nbytes, dtype=np.uint8)
        _local.stage = cur
    return cur

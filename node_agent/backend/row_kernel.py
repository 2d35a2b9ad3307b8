"""The CPU row kernel: rows written to scattered destination rows between CPU tensors.

A *row* is one unit of a plane (one token, or one page): a dense run of bytes.
:func:`gather`, :func:`scatter`, :func:`gather_scatter` and :func:`copy_run` move rows between
two C-contiguous CPU tensors viewed as numpy arrays with one opaque ``void``
element per row, so each row is one copy whatever the dtype (torch's
``index_copy_`` copies element by element), on the calling thread only (no
torch intra-op threads: the copy lanes share the cores) and with the GIL
released.

Two implementations, the same bytes. When the package was built with a C
compiler, ``_rowcopy`` (a plain shared library, loaded with ctypes) copies each
row with non-temporal (streaming) stores on x86-64: the destination line is not
read before it is written, which makes a copy of scattered 2 KiB rows as fast as
a flat ``memcpy`` or faster, where any copy through the caches stays near 0.7
of it (docs/backend.md, "Where the bytes go"); a move between two scattered
sides is then one pass, without staging. Without the library (no compiler at
install time, or ``FLEXKV_ROW_KERNEL=numpy``) numpy's ``take`` / ``put`` copy
each row with one ``memmove``, and a move between two scattered sides goes
through this thread's staging buffer, grown on demand up to
``STAGING_MAX_BYTES`` (larger moves go in pieces) and reused by later calls, so
no call allocates row memory and no thread keeps more than that. :data:`NATIVE`
says which one runs.

Contract: indices are int64 row numbers; the caller bounds them (``RowOp``
records each index's range once and checks it against the tensors before any
byte moves), because neither implementation checks (the numpy calls clip:
numpy's raising mode first copies the whole output, doubling the bytes moved);
destination rows must not repeat and the two arrays must not overlap.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import threading

import numpy as np
import numpy.typing as npt
import torch

Index = npt.NDArray[np.int64]

_local = threading.local()
_log = logging.getLogger(__name__)


def _load_native() -> ctypes.CDLL | None:
    """The ``_rowcopy`` library built next to this module, or None when it was not
    built (or ``FLEXKV_ROW_KERNEL=numpy`` asks for the numpy kernel)."""
    if os.environ.get("FLEXKV_ROW_KERNEL", "").lower() == "numpy":
        return None
    spec = importlib.util.find_spec(f"{__package__}._rowcopy")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as exc:
        _log.warning("Row copy library did not load; copying rows with numpy",
                     extra={"path": spec.origin, "error": str(exc)})
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rowcopy_gather.argtypes = [p, p, p, i64, i64]
    lib.rowcopy_scatter.argtypes = [p, p, p, i64, i64]
    lib.rowcopy_gather_scatter.argtypes = [p, p, p, p, i64, i64]
    lib.rowcopy_run.argtypes = [p, p, i64, i64]
    for fn in (lib.rowcopy_gather, lib.rowcopy_scatter, lib.rowcopy_gather_scatter,
               lib.rowcopy_run):
        fn.restype = None
    lib.rowcopy_level.argtypes = []
    lib.rowcopy_level.restype = ctypes.c_int
    return lib


_native = _load_native()
#: True when rows are copied by the streaming-store library, False with numpy.
NATIVE = _native is not None


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


def _addr(a: npt.NDArray[np.generic]) -> int:
    return int(a.ctypes.data)


def _use_native(dst: npt.NDArray[np.void], src: npt.NDArray[np.void],
                *indices: Index) -> bool:
    """Whether the library may copy these arrays: loaded, C-contiguous rows of one
    width, contiguous int64 indices, and ``dst`` and ``src`` apart in memory (numpy
    copies overlapping arrays correctly; the library does not)."""
    return (_native is not None and dst.flags.c_contiguous and src.flags.c_contiguous
            and dst.dtype.itemsize == src.dtype.itemsize
            and all(i.dtype == np.int64 and i.flags.c_contiguous for i in indices)
            and not np.may_share_memory(dst, src))


def gather(dst: npt.NDArray[np.void], d: int, src: npt.NDArray[np.void],
           index: Index) -> None:
    """``dst[d:d+len(index)] = src[index]``, straight into place (``IndexError`` when
    that slice is not inside ``dst``; the caller bounds ``index``)."""
    n = len(index)
    _check_run("gather destination", d, n, len(dst))
    if _native is None or not _use_native(dst, src, index):
        np.take(src, index, out=dst[d:d + n], mode="clip")
        return
    row = dst.dtype.itemsize
    _native.rowcopy_gather(_addr(dst) + d * row, _addr(src), _addr(index), n, row)


def scatter(dst: npt.NDArray[np.void], index: Index, src: npt.NDArray[np.void],
            s: int) -> None:
    """``dst[index] = src[s:s+len(index)]`` (``index`` must not repeat a row;
    ``IndexError`` when that slice is not inside ``src``; the caller bounds ``index``)."""
    n = len(index)
    _check_run("scatter source", s, n, len(src))
    if _native is None or not _use_native(dst, src, index):
        np.put(dst, index, src[s:s + n], mode="clip")
        return
    row = dst.dtype.itemsize
    _native.rowcopy_scatter(_addr(dst), _addr(index), _addr(src) + s * row, n, row)


def copy_run(dst: npt.NDArray[np.void], d: int, src: npt.NDArray[np.void], s: int,
             n: int) -> None:
    """``dst[d:d+n] = src[s:s+n]``: with the library, one flat copy with streaming
    stores (a store into cold tier rows does not read them first); else numpy's
    ``copyto``, which also copies overlapping runs correctly. ``IndexError`` when
    either run is not inside its array, before any byte moves."""
    _check_run("run destination", d, n, len(dst))
    _check_run("run source", s, n, len(src))
    if _native is None or not _use_native(dst, src):
        np.copyto(dst[d:d + n], src[s:s + n])
        return
    row = dst.dtype.itemsize
    _native.rowcopy_run(_addr(dst) + d * row, _addr(src) + s * row, n, row)


def _check_run(what: str, start: int, n: int, rows: int) -> None:
    """Refuse a run of ``n`` rows from ``start`` that is not inside ``rows`` rows: the
    library would copy past the array where numpy refused the shape."""
    if start < 0 or start + n > rows:
        raise IndexError(f"{what} rows {start}..{start + n} lie outside its {rows} rows; "
                         "plan the move with the buffers it copies")


#: The most staging bytes a thread keeps: a larger move goes through it in pieces,
#: so no thread holds more than this outside the tiers' budgets.
STAGING_MAX_BYTES = 16 << 20


def gather_scatter(dst: npt.NDArray[np.void], dst_index: Index, src: npt.NDArray[np.void],
                   src_index: Index) -> None:
    """``dst[dst_index] = src[src_index]``: one pass with the library, else through
    this thread's staging buffer, in pieces of at most :data:`STAGING_MAX_BYTES` (a
    row larger than that is one piece). ``ValueError`` when the two indices differ
    in length; the caller bounds them."""
    n = len(src_index)
    if len(dst_index) != n:
        raise ValueError(f"gather_scatter: {len(dst_index)} destination rows for {n} "
                         "source rows; give one destination row per source row")
    row = src.dtype.itemsize
    if _native is not None and _use_native(dst, src, dst_index, src_index):
        _native.rowcopy_gather_scatter(_addr(dst), _addr(dst_index), _addr(src),
                                       _addr(src_index), n, row)
        return
    step = max(1, STAGING_MAX_BYTES // row)
    size = min(n, step) * row
    # Exactly `size` bytes: the buffer may have grown for rows of another width.
    stage = _staging(size)[:size].view(src.dtype)
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

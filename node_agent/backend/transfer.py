"""Copies between registered engine buffers and tier blocks, batched per task.

A copy moves *rows* (one token, or one page of ``tpb`` tokens, of one plane)
between an engine plane and a CPU tier region (or the SSD staging buffer).
Which source row goes to which destination row is the same for every plane and
rank of a task, so it is planned once per task (:func:`plan_rows`) and then
applied plane by plane with a handful of row ops, never a Python step per
token or block:

* runs where both sides advance by one become slice copies;
* a contiguous destination fed from scattered rows becomes one gather straight
  into place;
* destinations scattered over more than :data:`MAX_SEGMENTS` runs become one
  scatter when the source rows are few runs, else one gather into a reused
  staging buffer and one scatter.

Slices are ``copy_`` and gathers ``index_select(out=...)``; between two CPU
tensors of contiguous rows a scatter, a general op (and, with the ``_rowcopy``
library, a gather) is one call of :mod:`.row_kernel` (GIL released, no torch
intra-op threads); CUDA or strided rows scatter with ``index_copy_``. With the
library, a plan of several ops between two CPU tensors of contiguous rows runs
as one general kernel call over all its rows instead (:class:`RowPlan`): a
load of scattered whole pages is otherwise one torch ``copy_`` per page. Every
plan checks all its rows against both tensors before any byte moves.

Sorting by destination first means a load into any permutation of a dense slot
range (SGLang with page size 1 hands out such sets) is a gather too.

Copy unit: when every block's slots are one aligned engine page (``tpb``
consecutive slots starting at a multiple of ``tpb``, as SGLang allocates with
``page_size == tokens_per_block``), planes are indexed by page - rows of
``tpb`` tokens - instead of by token, which makes every row copy 16x longer.
Otherwise they are indexed by token. Both give the same bytes. Paged layouts
(vLLM's ``layer_block_head_token_kv``) are copied by page only: their slot
mappings must be whole, aligned pages.

The same calls work for CUDA engine buffers and for CPU tensors. Between CUDA
buffers and a pinned tier, rows that are not one run move by one launch of the
GPU row kernel per plane (:mod:`.mapped_rows`), which reads and writes the
pinned rows where they are; where it cannot run, through staging (below). A
CUDA device is synchronised before a copy reports done.

Stopping: ``store`` and ``load`` take an optional ``abort`` event and check it
before every row op of every plane and every SSD block copy; once it is set
they synchronise the devices (no queued write is still in flight) and raise
:class:`CopyAborted`. A copy therefore stops within one row op (at most one
plane) of the request; the bytes it already wrote (engine slots for a load,
tier blocks for a store) are undefined.
"""

from __future__ import annotations

import enum
import functools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from node_agent.backend import mapped_rows, row_kernel
from node_agent.backend.cpu_tier import CpuTier
from node_agent.backend.lanes import run_items
from node_agent.backend.planes import RegisteredBuffers
from node_agent.vocab.layout import KVLayout
from node_agent.vocab.placement import BlockLocation, Tier

if TYPE_CHECKING:  # an engine's copier (node_agent.engine_loads) has no SSD tier
    from node_agent.backend.ssd_tier import SsdTier

#: At most this many slice / gather ops per plane; beyond, one vectorised scatter.
MAX_SEGMENTS = 16
#: A stretch of consecutive rows shorter than this (on average) is gathered, not sliced.
MIN_SLICE_ROWS = 16
#: Copies smaller than this run in one lane (handing planes over costs more).
LANE_MIN_BYTES = 4 * 1024 * 1024
#: SSD loads go through a per-thread staging buffer of about this many bytes.
STAGING_BYTES = 64 * 1024 * 1024
#: A gather from host rows into device rows moves the span of host rows it reads
#: to the device in pieces of at most this many bytes and gathers there.
DEVICE_STAGE_BYTES = 32 * 1024 * 1024
#: ... when that span holds at most this many times the rows the op reads (else
#: the host gathers, and the device receives only the rows it needs). On an H200
#: host the span moved 22.6 GB/s of useful rows at twice the rows (45 GB/s in
#: transfer) and the host's gather 9.2 GB/s: four times still leaves the span ahead.
DEVICE_STAGE_MAX_SPAN = 4
#: Pinned host memory each copying thread keeps (allocated at its first use) for
#: the moves between scattered host rows and a device: two halves, so that one
#: half is gathered or scattered by the host while the other is in transfer.
HOST_STAGE_BYTES = 32 * 1024 * 1024
#: False: host <-> device row ops run plain torch ops instead of the GPU row kernel
#: (:mod:`.mapped_rows`) and the staged moves (:meth:`RowOp.apply_staged`,
#: :meth:`RowOp.apply_host_gathered`, :meth:`RowOp.apply_host_scattered`);
#: ``bench/transfer.py --direct`` measures both.
DEVICE_STAGING = True

Rows = npt.NDArray[np.int64]


class CopyAborted(RuntimeError):
    """A copy stopped early because its abort event was set; what it wrote is undefined."""


def run_starts(rows: Rows) -> Rows:
    """Offsets where the maximal runs of ``rows`` that advance by one start
    (``[0]`` for one run, empty for no rows)."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    return np.concatenate((np.zeros(1, dtype=np.int64), breaks.astype(np.int64)))


def unit_rows(blocks: Sequence[int] | Rows, units: int) -> Rows:
    """Row indices of every unit of ``blocks`` (or block positions), ``units`` per block."""
    base = np.asarray(blocks, dtype=np.int64)
    if units == 1:
        return base
    return (base[:, None] * units + np.arange(units, dtype=np.int64)).reshape(-1)


def page_index(slots: torch.Tensor, tpb: int) -> torch.Tensor | None:
    """Per-block engine page ids when each block's slots are one aligned page, else None."""
    if tpb == 1 or not len(slots):
        return None
    per_block = slots.view(-1, tpb).numpy()
    first = per_block[:, 0]
    if (first % tpb).any():
        return None
    if not (per_block == first[:, None] + np.arange(tpb)).all():
        return None
    return torch.from_numpy(first // tpb)


class OpKind(enum.Enum):
    """How one :class:`RowOp` moves rows."""

    SLICE = "slice"
    """``dst[d:d+n] = src[s:s+n]``"""
    GATHER = "gather"
    """``dst[d:d+n] = src[src_index]``"""
    SCATTER = "scatter"
    """``dst[dst_index] = src[s:s+n]``"""
    GENERAL = "general"
    """``dst[dst_index] = src[src_index]`` (through a temporary)"""


class RowOp:
    """One vectorised row move, the same for every plane; index tensors are cached
    per device, and the rows each side touches are recorded once so that every
    apply checks them against the tensors before any byte moves."""

    __slots__ = (
        "_dst_hi",
        "_dst_index",
        "_dst_np",
        "_on",
        "_pieces",
        "_src_hi",
        "_src_index",
        "_src_np",
        "_stages",
        "dst_start",
        "kind",
        "length",
        "src_start",
    )

    def __init__(self, kind: OpKind, dst_start: int = 0, src_start: int = 0, length: int = 0,
                 dst_index: Rows | None = None, src_index: Rows | None = None) -> None:
        self.kind = kind
        self.dst_start = dst_start
        self.src_start = src_start
        self.length = length
        self._dst_np = _index_array(dst_index, "dst")
        self._src_np = _index_array(src_index, "src")
        self._dst_hi = _rows_needed(self._dst_np, dst_start, length)
        self._src_hi = _rows_needed(self._src_np, src_start, length)
        self._dst_index = None if self._dst_np is None else torch.from_numpy(self._dst_np)
        self._src_index = None if self._src_np is None else torch.from_numpy(self._src_np)
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._stages: dict[tuple[torch.device, int], list[_Stage] | None] = {}
        self._pieces: dict[tuple[str, torch.device, int], list[_Piece]] = {}

    def index(self, which: str, device: torch.device) -> torch.Tensor:
        """The ``"dst"`` or ``"src"`` row index on ``device``."""
        t = self._dst_index if which == "dst" else self._src_index
        assert t is not None, f"{self.kind.value} op has no {which} index"
        if device.type == "cpu":
            return t
        key = (which, device)
        got = self._on.get(key)
        if got is None:
            got = self._on[key] = _to_device(t, device)
        return got

    def apply(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Move this op's rows from ``src`` into ``dst`` (2-D, rows first).

        Raises ``IndexError`` when a row lies outside either tensor and
        ``ValueError`` when their rows differ in dtype or width, in both cases
        before any byte moves. Between two CPU tensors of contiguous rows, a
        scatter or general op runs :mod:`.row_kernel` (one GIL-free call, on this
        thread only), and so do a slice and a gather where its streaming-store
        library is built (``row_kernel.NATIVE``). Between host and CUDA memory, a
        gather or general op into the device and a scatter or general op out of
        it go through staging (:meth:`_across`); everything else runs torch ops."""
        _check_fit(self, self._dst_hi, self._src_hi, dst, src)
        kind = self.kind
        if kind is OpKind.SCATTER or kind is OpKind.GENERAL or row_kernel.NATIVE:
            d_rows = row_kernel.row_array(dst)
            s_rows = row_kernel.row_array(src) if d_rows is not None else None
            if d_rows is not None and s_rows is not None:
                self._kernel_rows(d_rows, s_rows)
                return
        d, s, n = self.dst_start, self.src_start, self.length
        if DEVICE_STAGING and src.device.type != dst.device.type and self._across(dst, src):
            return
        if kind is OpKind.SLICE:
            dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
        elif kind is OpKind.GATHER:
            out = dst[d:d + n]
            idx = self.index("src", src.device)
            if src.device == dst.device and out.is_contiguous():
                torch.index_select(src, 0, idx, out=out)
            else:
                out.copy_(src.index_select(0, idx), non_blocking=True)
        elif kind is OpKind.SCATTER:
            dst.index_copy_(0, self.index("dst", dst.device), src[s:s + n].to(dst.device))
        else:
            rows = src.index_select(0, self.index("src", src.device))
            dst.index_copy_(0, self.index("dst", dst.device), rows.to(dst.device))

    def _across(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Move this op's rows between host and CUDA memory by the GPU row kernel
        (:meth:`apply_mapped`) where it runs, else through staging where a plain
        torch op would gather or scatter on the host through unpinned memory;
        False (nothing moved) where the plain op is the right one."""
        kind = self.kind
        if self.apply_mapped(dst, src):
            return True
        if src.device.type == "cpu" and dst.device.type == "cuda":
            if kind is not OpKind.GATHER and kind is not OpKind.GENERAL:
                return False
            # A span from unpinned memory (an engine reading a shared tier) goes
            # through the driver's own staging: only the rows read are sent then.
            return bool(src.is_pinned() and self.apply_staged(dst, src)) or (
                self.apply_host_gathered(dst, src))
        if src.device.type == "cuda" and dst.device.type == "cpu":
            return (kind is OpKind.SCATTER or kind is OpKind.GENERAL) and (
                self.apply_host_scattered(dst, src))
        return False

    def apply_mapped(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Move this op's rows between CUDA memory and pinned host memory with one
        launch of the GPU row kernel (:func:`mapped_rows.move_rows`: the kernel
        reads and writes the host rows where they are); False, moving nothing,
        for a slice (one copy-engine transfer is the fast case there) or where
        the kernel cannot run. Fit is checked by the caller."""
        if self.kind is OpKind.SLICE:
            return False
        cuda = dst.device if dst.device.type == "cuda" else src.device
        if cuda.type != "cuda":
            return False
        return mapped_rows.move_rows(
            dst, None if self._dst_np is None else functools.partial(self.index, "dst", cuda),
            self.dst_start,
            src, None if self._src_np is None else functools.partial(self.index, "src", cuda),
            self.src_start, self.length)

    def apply_staged(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Move this op's rows by copying the span of ``src`` rows it reads to
        ``dst``'s device in pieces of at most :data:`DEVICE_STAGE_BYTES` (one
        contiguous transfer each, the copy engine's fast case from pinned memory)
        and gathering them there. False when that span holds more than
        :data:`DEVICE_STAGE_MAX_SPAN` times the rows read (nothing moved), or when
        the device has no memory for a piece (earlier pieces moved: the caller
        moves every row again, which rewrites them with the same bytes).

        What a load of shuffled pages into GPU KV needs: gathering on the host
        first runs a CPU gather and a transfer from unpinned memory, at a tenth
        of the copy engine's rate. Transfers are queued on the current stream
        (the caller synchronises, as every copy does). Fit is checked by
        :meth:`apply`; called directly, the caller checks it."""
        stages = self._stage_plan(dst.device,
                                  max(1, DEVICE_STAGE_BYTES // _row_bytes(src)))
        if stages is None:
            return False
        try:
            for lo, hi, src_rows, dst_rows in stages:
                staged = src[lo:hi].to(dst.device, non_blocking=True)
                dst.index_copy_(0, dst_rows, staged.index_select(0, src_rows))
        except torch.cuda.OutOfMemoryError:
            # The device could not hold a piece's span: the caller moves the rows
            # another way (rewriting rows already moved with the same bytes).
            return False
        return True

    def apply_host_gathered(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Move this op's host rows ``src`` into ``dst`` (another device) in pieces:
        the host gathers a piece into one half of this thread's pinned stage
        (:data:`HOST_STAGE_BYTES`), which goes to the device in one transfer and is
        put in place there, while the host gathers the next piece into the other
        half. False, moving nothing, when one row does not fit a half.

        For loads whose tier rows are spread too thinly for :meth:`apply_staged`
        (a fragmented tier): the alternative, gathering into unpinned memory,
        transfers at a fraction of the copy engine's rate."""
        stage = _pinned_stage(dst.device)
        cap = stage.half // _row_bytes(src)
        if cap < 1:
            return False
        for i, (host_rows, device_rows) in enumerate(self._piece_plan("to", dst.device, cap)):
            area = stage.area(i % 2, len(host_rows), src)
            stage.wait(i % 2)  # the half's last transfer has read it
            torch.index_select(src, 0, torch.from_numpy(host_rows), out=area)
            moved = area.to(dst.device, non_blocking=True)
            stage.mark(i % 2, dst.device)
            dst.index_copy_(0, device_rows, moved)
        return True

    def apply_host_scattered(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Move this op's device rows ``src`` into host rows ``dst`` in pieces: the
        device gathers a piece into one transfer to a half of this thread's pinned
        stage, and the host scatters it into place while the next piece is in
        transfer to the other half. False, moving nothing, when one row does not
        fit a half. For stores into scattered tier blocks (a fragmented tier)."""
        stage = _pinned_stage(src.device)
        cap = stage.half // _row_bytes(src)
        if cap < 1:
            return False
        ready: tuple[int, Rows] | None = None
        for i, (host_rows, device_rows) in enumerate(self._piece_plan("from", src.device, cap)):
            area = stage.area(i % 2, len(host_rows), src)
            stage.wait(i % 2)
            area.copy_(src.index_select(0, device_rows), non_blocking=True)
            stage.mark(i % 2, src.device)
            if ready is not None:
                stage.scatter(ready[0], ready[1], dst)
            ready = (i % 2, host_rows)
        if ready is not None:
            stage.scatter(ready[0], ready[1], dst)
        return True

    def _piece_plan(self, way: str, device: torch.device, cap: int) -> list[_Piece]:
        """Pieces of at most ``cap`` rows: ``(host rows, device rows on device)``,
        in host-row order; ``way`` ``"to"`` the device (host rows are sources) or
        ``"from"`` it (host rows are destinations). Built once per way, device, cap."""
        key = (way, device, cap)
        got = self._pieces.get(key)
        if got is None:
            host, dev = self._sorted_by("src" if way == "to" else "dst")
            got = self._pieces[key] = [
                (np.ascontiguousarray(host[i:i + cap]),
                 torch.from_numpy(np.ascontiguousarray(dev[i:i + cap])).to(device))
                for i in range(0, len(host), cap)]
        return got

    def _stage_plan(self, device: torch.device, cap: int) -> list[_Stage] | None:
        """The pieces of :meth:`apply_staged` on ``device`` with at most ``cap``
        rows of span each (built once per device and cap)."""
        key = (device, cap)
        if key in self._stages:
            return self._stages[key]
        s, d = self._sorted_by("src")
        stages: list[_Stage] | None = None
        if len(s) and int(s[-1]) - int(s[0]) + 1 <= DEVICE_STAGE_MAX_SPAN * len(s):
            stages = []
            i = 0
            while i < len(s):
                lo = int(s[i])
                j = int(np.searchsorted(s, lo + cap, side="left"))
                stages.append((lo, int(s[j - 1]) + 1,
                               torch.from_numpy(s[i:j] - lo).to(device),
                               torch.from_numpy(np.ascontiguousarray(d[i:j])).to(device)))
                i = j
        self._stages[key] = stages
        return stages

    def _sorted_by(self, side: str) -> tuple[Rows, Rows]:
        """``(rows of side, the other side's rows)``, ordered by ``side``'s rows
        (``"src"`` or ``"dst"``; stable, so repeated sources keep their order)."""
        d_rows, s_rows = self.rows()
        key, other = (s_rows, d_rows) if side == "src" else (d_rows, s_rows)
        order = np.argsort(key, kind="stable")
        return key[order], other[order]

    def rows(self) -> tuple[Rows, Rows]:
        """``(destination rows, source rows)`` this op moves, one pair per row."""
        n = self.length
        d = self._dst_np if self._dst_np is not None else np.arange(
            self.dst_start, self.dst_start + n, dtype=np.int64)
        s = self._src_np if self._src_np is not None else np.arange(
            self.src_start, self.src_start + n, dtype=np.int64)
        return d, s

    def _kernel_rows(self, dst: npt.NDArray[np.void], src: npt.NDArray[np.void]) -> None:
        """This op on rows as numpy ``void`` elements (bounds checked)."""
        if self.kind is OpKind.SLICE:
            row_kernel.copy_run(dst, self.dst_start, src, self.src_start, self.length)
            return
        if self.kind is OpKind.GATHER:
            assert self._src_np is not None
            row_kernel.gather(dst, self.dst_start, src, self._src_np)
            return
        assert self._dst_np is not None
        if self.kind is OpKind.SCATTER:
            row_kernel.scatter(dst, self._dst_np, src, self.src_start)
        else:
            assert self._src_np is not None
            row_kernel.gather_scatter(dst, self._dst_np, src, self._src_np)

    def __repr__(self) -> str:
        return (f"RowOp({self.kind.value}, dst_start={self.dst_start}, "
                f"src_start={self.src_start}, length={self.length})")


_Stage = tuple[int, int, torch.Tensor, torch.Tensor]
"""One piece of a staged move: source rows ``[lo, hi)`` sent to the device whole,
then rows ``src_rows`` (relative to ``lo``) of them put at ``dst_rows``."""
_Piece = tuple[Rows, torch.Tensor]
"""One piece of a move through the pinned stage: host rows, device rows (on the device)."""


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``. To a CUDA device through pinned memory and
    without blocking the host: queued on the device's current stream, ahead of the
    kernels that read it (torch's pinned allocator keeps the pinned copy until the
    transfer ended); a pageable copy would stall the host until it lands."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _row_bytes(t: torch.Tensor) -> int:
    return max(1, t.element_size() * math.prod(t.shape[1:]))


class _PinnedStage:
    """One thread's staging memory for host <-> device row moves: two halves, each
    with the event of the last transfer that used it (pinned and evented only for
    CUDA devices; plain memory and no events otherwise, which tests use)."""

    def __init__(self, nbytes: int, cuda: bool) -> None:
        self.nbytes = nbytes
        self.half = nbytes // 2 // 64 * 64
        self.buf = torch.empty(2 * self.half, dtype=torch.uint8, pin_memory=cuda)
        self.events: list[Any] = [None, None]

    def area(self, h: int, rows: int, like: torch.Tensor) -> torch.Tensor:
        """``rows`` rows shaped like ``like``'s at the start of half ``h``."""
        raw = self.buf[h * self.half:h * self.half + rows * _row_bytes(like)]
        return raw.view(like.dtype).view(rows, *like.shape[1:])

    def wait(self, h: int) -> None:
        """Until the last transfer that used half ``h`` has finished."""
        ev = self.events[h]
        if ev is not None:
            ev.synchronize()

    def mark(self, h: int, device: torch.device) -> None:
        """Half ``h`` is in a transfer just queued on ``device``'s current stream."""
        if device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
            self.events[h] = ev

    def scatter(self, h: int, host_rows: Rows, dst: torch.Tensor) -> None:
        """Put half ``h``'s rows (once their transfer finished) at ``host_rows``."""
        self.wait(h)
        dst.index_copy_(0, torch.from_numpy(host_rows), self.area(h, len(host_rows), dst))


_stages_local = threading.local()


def _pinned_stage(device: torch.device) -> _PinnedStage:
    """This thread's :class:`_PinnedStage` for moves with ``device``."""
    cuda = device.type == "cuda"
    key = "cuda" if cuda else "plain"
    got: _PinnedStage | None = getattr(_stages_local, key, None)
    if got is None or got.nbytes != HOST_STAGE_BYTES:
        got = _PinnedStage(HOST_STAGE_BYTES, cuda)
        setattr(_stages_local, key, got)
    return got


def _check_fit(what: object, dst_hi: int, src_hi: int, dst: torch.Tensor,
               src: torch.Tensor) -> None:
    """Raise ``IndexError`` unless ``dst`` holds ``dst_hi`` rows and ``src`` ``src_hi``,
    and ``ValueError`` unless their rows have one dtype and width."""
    if dst_hi > dst.shape[0] or src_hi > src.shape[0]:
        raise IndexError(
            f"{what!r} needs {dst_hi} destination and {src_hi} source rows, "
            f"but the tensors hold {dst.shape[0]} and {src.shape[0]}; the row plan does "
            "not fit these buffers (plan and copy them with the same slots and blocks)"
        )
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise ValueError(
            f"{what!r}: destination rows are {dst.dtype} x {tuple(dst.shape[1:])} but "
            f"source rows are {src.dtype} x {tuple(src.shape[1:])}; both sides must view "
            "their rows with the same dtype and width"
        )


def _index_array(index: Rows | None, which: str) -> Rows | None:
    """``index`` as a contiguous int64 array (``ValueError`` naming a negative row)."""
    if index is None:
        return None
    arr = np.ascontiguousarray(index, dtype=np.int64)
    if len(arr) and int(arr.min()) < 0:
        raise ValueError(f"row op {which} index holds negative row {int(arr.min())}; rows "
                         "are numbered from 0")
    return arr


def _rows_needed(index: Rows | None, start: int, length: int) -> int:
    """How many rows a side must hold: past its highest indexed row, or its slice's end."""
    if index is not None:
        return int(index.max()) + 1 if len(index) else 0
    if start < 0:
        raise ValueError(f"row op slice starts at negative row {start}; rows are numbered "
                         "from 0")
    return start + length


def plan_rows(dst: Rows, src: Rows, max_ops: int = MAX_SEGMENTS,
              min_slice: int = MIN_SLICE_ROWS) -> list[RowOp]:
    """Ops that together perform ``dst_rows[dst[i]] = src_rows[src[i]]`` for every
    ``i``; ``dst`` must not repeat a row (``src`` may).

    Sorted by destination, the rows split into runs of consecutive destinations;
    with at most ``max_ops`` of them each is one slice copy per stretch of
    consecutive sources (when that keeps within ``max_ops`` ops and the stretches
    average ``min_slice`` rows; a single stretch always) or else one gather.
    More destination runs than that: one scatter per run of consecutive sources
    (sorted by source) when there are at most ``max_ops``, else one general op.
    """
    dst = np.asarray(dst, dtype=np.int64)
    src = np.asarray(src, dtype=np.int64)
    if dst.shape != src.shape or dst.ndim != 1:
        raise ValueError(f"plan_rows: dst {dst.shape} and src {src.shape} must be equal 1-D "
                         "shapes (one source row per destination row)")
    n = len(dst)
    if not n:
        return []
    if n > 1 and not bool((dst[1:] > dst[:-1]).all()):
        order = np.argsort(dst, kind="stable")
        d, s = dst[order], src[order]
    else:
        d, s = dst, src
    starts = run_starts(d)
    if len(starts) <= max_ops:
        ops: list[RowOp] = []
        share = max(1, max_ops // len(starts))
        ends = np.append(starts[1:], n)
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            part = s[a:b]
            sub = run_starts(part)
            if len(sub) == 1 or (len(sub) <= share and (b - a) >= min_slice * len(sub)):
                sub_ends = np.append(sub[1:], b - a)
                ops.extend(RowOp(OpKind.SLICE, int(d[a + x]), int(part[x]), int(y - x))
                           for x, y in zip(sub.tolist(), sub_ends.tolist(), strict=True))
            else:
                ops.append(RowOp(OpKind.GATHER, int(d[a]), length=b - a, src_index=part))
        return ops
    order = np.argsort(src, kind="stable")
    d, s = dst[order], src[order]
    starts = run_starts(s)
    if len(starts) <= max_ops:
        ends = np.append(starts[1:], n)
        return [RowOp(OpKind.SCATTER, src_start=int(s[a]), length=b - a, dst_index=d[a:b])
                for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    return [RowOp(OpKind.GENERAL, length=n, dst_index=dst, src_index=src)]


class RowPlan:
    """The row ops of one plan (:func:`plan_rows`), applied to every plane of a task.

    With the row kernel's library (``row_kernel.NATIVE``) a plan of several ops also
    holds one general op over all their rows (``fused``): between two CPU tensors of
    contiguous rows it moves the whole plan in one GIL-free call with streaming
    stores, where the ops would be one torch ``copy_`` per slice (a load of scattered
    whole pages, vLLM's paged layout, is one single-page slice per page). Both give
    the same bytes. Other tensors (CUDA, strided rows) run the ops. Either way every
    row of the whole plan is checked against both tensors, and their row dtype and
    width, before any byte moves (so a plan that does not fit moves nothing, not
    the ops before the one that does not fit)."""

    __slots__ = ("_dst_hi", "_general", "_src_hi", "fused", "ops")

    def __init__(self, ops: list[RowOp]) -> None:
        self.ops = ops
        self.fused = _fuse(ops) if row_kernel.NATIVE and len(ops) > 1 else None
        self._general = self.fused
        self._dst_hi = max((op._dst_hi for op in ops), default=0)
        self._src_hi = max((op._src_hi for op in ops), default=0)

    def apply(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Move the plan's rows from ``src`` into ``dst`` (see :meth:`RowOp.apply`;
        the same errors, raised for the whole plan before any byte moves). Between
        CUDA and pinned host memory a plan of several ops is one launch of the GPU
        row kernel where it runs (a load of scattered whole pages would otherwise
        be one transfer per page and plane)."""
        _check_fit(self, self._dst_hi, self._src_hi, dst, src)
        fused = self.fused
        if (fused is not None and row_kernel.row_array(dst) is not None
                and row_kernel.row_array(src) is not None):
            fused.apply(dst, src)
            return
        if DEVICE_STAGING and len(self.ops) > 1 and dst.device.type != src.device.type:
            if self._general is None:
                self._general = _fuse(self.ops)
            if self._general.apply_mapped(dst, src):
                return
        for op in self.ops:
            op.apply(dst, src)


    def __repr__(self) -> str:
        return f"RowPlan({len(self.ops)} ops, fused={self.fused is not None})"


def _fuse(ops: Sequence[RowOp]) -> RowOp:
    """One general op moving every row of ``ops`` (whose destinations do not repeat)."""
    pairs = [op.rows() for op in ops]
    return RowOp(OpKind.GENERAL, length=sum(len(d) for d, _ in pairs),
                 dst_index=np.concatenate([d for d, _ in pairs]),
                 src_index=np.concatenate([s for _, s in pairs]))


def _store_plan(blocks: Sequence[int], units: int, idx: Rows) -> RowPlan:
    """The row plan of a store: engine rows ``idx`` into the rows of tier ``blocks``."""
    return RowPlan(plan_rows(unit_rows(blocks, units), idx))


def _load_plan(idx: Rows, blocks: Sequence[int], positions: Sequence[int],
               units: int) -> RowPlan:
    """The row plan of a CPU load: the rows of tier ``blocks`` into the engine rows of
    ``idx`` at ``positions`` (block positions within the task)."""
    return RowPlan(plan_rows(idx[unit_rows(positions, units)], unit_rows(blocks, units)))


def _synchronize(devices: set[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


class _Units:
    """One task's slot mapping: token slots, and page ids when aligned; row plans
    computed once per task and reused for every plane, rank and device."""

    def __init__(self, slots: torch.Tensor, pages: torch.Tensor | None, tpb: int) -> None:
        self.tpb = tpb
        self.tokens = slots.numpy()
        self.pages = pages.numpy() if pages is not None else None
        self._plans: dict[tuple[str, int], RowPlan] = {}

    def pick(self, buf: RegisteredBuffers, p: int) -> tuple[torch.Tensor, Rows, int]:
        """``(plane p of buf as rows of one unit, unit index, units per block)``:
        pages where the slots are whole pages (and the plane's rows are dense, or
        its rows are pages already), else tokens."""
        plane = buf.wide_planes[p]
        if buf.paged:
            assert self.pages is not None  # checked in BlockCopier._units
            return plane, self.pages, 1
        if self.pages is not None:
            by_page = buf.page_planes(self.tpb)[p]
            if by_page is not None:
                return by_page, self.pages, 1
        return plane, self.tokens, self.tpb

    def plan(self, key: str, units: int, build: Callable[[], RowPlan]) -> RowPlan:
        """The row plan ``key`` for ``units`` rows per block, built once."""
        got = self._plans.get((key, units))
        if got is None:
            got = self._plans[(key, units)] = build()
        return got


class BlockCopier:
    """Moves KV between engine buffers, the CPU tier and the SSD tier of one stage."""

    def __init__(self, layout: KVLayout, cpu: CpuTier, ssd: SsdTier | None,
                 lanes: int = 1) -> None:
        """``lanes``: threads that share the planes of one CPU copy of at least
        :data:`LANE_MIN_BYTES` (:mod:`.lanes`); 1 copies plane after plane."""
        self.layout = layout
        self.cpu = cpu
        self.ssd = ssd
        self.lanes = lanes
        self._local = threading.local()
        self._regions: dict[tuple[int, int, torch.dtype, int], torch.Tensor] = {}
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

    def _units(self, slots: torch.Tensor) -> _Units:
        tpb = self.layout.tokens_per_block
        pages = page_index(slots, tpb)
        if pages is None and self.layout.name.paged and len(slots):
            raise ValueError(
                f"layout {self.layout.name.value} is copied by whole pages, but the slots do "
                f"not form whole, aligned pages of {tpb} (slot = block * {tpb} + offset); "
                "pass every slot of each block, in order"
            )
        return _Units(slots, pages, tpb)

    def _region(self, stored_rank: int, plane: int, dtype: torch.dtype, units: int,
                ) -> torch.Tensor:
        """The CPU region of ``plane`` as rows of one unit (``units`` rows per block):
        a view of the tier's pool, which never moves, so each one is built once."""
        key = (stored_rank, plane, dtype, units)
        got = self._regions.get(key)
        if got is None:
            region = self.cpu.region(stored_rank, plane).view(dtype)
            got = self._regions[key] = region.view(self.cpu.num_blocks * units, -1)
        return got

    def _run(self, count: int, item: Callable[[int], Callable[[], None]],
             devices: set[torch.device], nbytes: int, abort: threading.Event | None) -> None:
        """Run ``item(i)()`` for every plane ``i < count``, checking ``abort`` before
        each; over several lanes when every buffer is a CPU tensor and the copy moves
        ``LANE_MIN_BYTES`` or more (every item built first, then shared). In one lane
        each item is built just before it runs: a CUDA copy's first transfer is
        queued while the host still plans the later planes, not after."""
        check = functools.partial(self._checkpoint, abort)
        cpu_only = all(d.type == "cpu" for d in devices)
        lanes = self.lanes if cpu_only and nbytes >= LANE_MIN_BYTES else 1
        if lanes <= 1:
            for i in range(count):
                check()
                item(i)()
            return
        run_items([item(i) for i in range(count)], lanes, check)

    def store(
        self, buffers: Mapping[int, RegisteredBuffers], blocks: Sequence[int],
        slots: torch.Tensor, abort: threading.Event | None = None,
    ) -> None:
        """Copy the tokens at ``slots`` (token order) into CPU ``blocks`` (block order).

        Raises :class:`CopyAborted` (blocks undefined) once ``abort`` is set."""
        lay = self.layout
        units = self._units(slots)
        devices = {buffers[r].device for r in range(lay.stored_ranks)}
        planes = lay.num_planes

        def item(i: int) -> Callable[[], None]:
            r, p = divmod(i, planes)
            src, idx, u = units.pick(buffers[r], p)
            region = self._region(r, p, src.dtype, u)
            plan = units.plan("store", u, functools.partial(_store_plan, blocks, u, idx))
            return functools.partial(plan.apply, region, src)

        try:
            self._run(lay.stored_ranks * planes, item, devices,
                      len(blocks) * lay.bytes_per_block, abort)
        finally:
            _synchronize(devices)

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
        cpu_pos: list[int] = []
        cpu_blk: list[int] = []
        ssd_pos: list[int] = []
        ssd_blk: list[int] = []
        for i, loc in enumerate(locations):
            if loc.tier is Tier.CPU:
                cpu_pos.append(i)
                cpu_blk.append(loc.index)
            elif loc.tier is Tier.SSD:
                ssd_pos.append(i)
                ssd_blk.append(loc.index)
        units = self._units(slots)
        try:
            if cpu_pos:
                self._load_cpu(buffers, cpu_pos, cpu_blk, units, abort)
            if ssd_pos and not self._load_ssd_direct(buffers, ssd_pos, ssd_blk, units,
                                                     abort):
                step = max(1, STAGING_BYTES // self.layout.bytes_per_block)
                for c in range(0, len(ssd_pos), step):
                    self._load_ssd(buffers, ssd_pos[c : c + step], ssd_blk[c : c + step],
                                   units, abort)
        finally:
            _synchronize({b.device for b in buffers.values()})

    def _load_cpu(
        self,
        buffers: Mapping[int, RegisteredBuffers],
        positions: Sequence[int],
        blocks: Sequence[int],
        units: _Units,
        abort: threading.Event | None,
    ) -> None:
        lay = self.layout
        ranks = list(buffers.items())
        planes = lay.num_planes

        def item(i: int) -> Callable[[], None]:
            k, p = divmod(i, planes)
            rank, buf = ranks[k]
            dst, idx, u = units.pick(buf, p)
            region = self._region(0 if lay.is_mla else rank, p, dst.dtype, u)
            plan = units.plan("load_cpu", u, functools.partial(
                _load_plan, idx, blocks, positions, u))
            return functools.partial(plan.apply, dst, region)

        nbytes = len(blocks) * lay.bytes_per_block * (len(buffers) if lay.is_mla else 1)
        self._run(len(ranks) * planes, item, {b.device for b in buffers.values()}, nbytes,
                  abort)

    def _load_ssd_direct(
        self,
        buffers: Mapping[int, RegisteredBuffers],
        positions: Sequence[int],
        blocks: Sequence[int],
        units: _Units,
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
        if units.pages is None:
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
        units: _Units,
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
        plans: dict[int, RowPlan] = {}  # this chunk's plans (positions differ per chunk)
        for rank, buf in buffers.items():
            sr = 0 if lay.is_mla else rank
            for p in range(lay.num_planes):
                dst, idx, u = units.pick(buf, p)
                k = sr * lay.num_planes + p
                data = staging[k, : len(blocks)].view(dst.dtype).view(len(blocks) * u, -1)
                if u not in plans:
                    plans[u] = RowPlan(plan_rows(idx[unit_rows(positions, u)],
                                                 np.arange(len(blocks) * u, dtype=np.int64)))
                self._checkpoint(abort)
                plans[u].apply(dst, data)

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

"""Row moves between CUDA memory and pinned host memory by one GPU kernel.

Page-locked host memory that CUDA allocated or registered (torch's
``pin_memory``, the pinned CPU tier) is mapped into the device's address space
on 64-bit hosts with unified addressing, so a kernel reads and writes it
directly over the host link. A move of rows between such memory and device
memory, however scattered either side is, is then one kernel launch: each
program copies one piece of one row, with no gather or scatter on the host, no
staging buffer and no second pass over the bytes on either side. The staged
moves of :mod:`.transfer` (span transfer, two-half pinned stage) remain for
hosts where this cannot run.

:func:`move_rows` is the whole contract. It runs where ``triton`` imports (every
CUDA build of torch on Linux installs it) and is switched off with
``FLEXKV_MAPPED_ROWS=0`` in the environment (or :data:`ENABLED` = False).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

_log = logging.getLogger(__name__)

#: False: :func:`move_rows` moves nothing (the staged moves run instead);
#: ``FLEXKV_MAPPED_ROWS=0`` sets it at import, ``bench/transfer.py --no-mapped`` too.
ENABLED = os.environ.get("FLEXKV_MAPPED_ROWS", "1").strip().lower() not in ("0", "false", "no")
#: At most this many bytes of one row per program (a power of two), and the warps
#: of a program (``bench/mapped_rows.py`` compares settings).
BLOCK_BYTES = 8192
WARPS = 4

# Launches are queued on one stream anyway; the lock keeps two copying threads
# (workers of different stages) from compiling the same kernel variant at once.
_launch_lock = threading.Lock()


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, or None where Triton does not import (logged once)."""
    try:
        return importlib.import_module("node_agent.backend._mapped_kernel").move_rows_kernel
    except Exception as exc:  # ImportError, or a Triton that cannot load its driver
        _log.info("Host <-> device row moves go through staging: the GPU row kernel "
                  "is not available", extra={"reason": f"{type(exc).__name__}: {exc}"})
        return None


def _byte_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """``(t as bytes, row stride in bytes, row width in bytes)`` for a 2-D tensor
    whose rows are contiguous; None otherwise."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        return None
    size = t.element_size()
    raw = t.view(torch.uint8) if size > 1 else t
    return raw, t.stride(0) * size, t.shape[1] * size


def _side_ok(t: torch.Tensor, cuda: torch.device) -> bool:
    """``t`` is on ``cuda`` itself, or is pinned host memory (mapped on ``cuda``)."""
    if t.device.type == "cuda":
        return t.device == cuda
    return t.device.type == "cpu" and t.is_pinned()


Index = torch.Tensor | Callable[[], torch.Tensor] | None
"""A side's row index: a tensor, a callable giving one (called only once the kernel
is sure to run, so that no index is uploaded for nothing), or None (rows
``start + i``)."""


def move_rows(dst: torch.Tensor, dst_rows: Index, dst_start: int,
              src: torch.Tensor, src_rows: Index, src_start: int, length: int) -> bool:
    """Queue ``dst[dst_rows[i]] = src[src_rows[i]]`` for ``i < length`` as one
    kernel on the CUDA side's current stream; a side without an index
    (:data:`Index`) uses rows ``start + i``. True when queued; False, moving nothing, when it
    cannot run here: switched off, no Triton, neither side on a CUDA device,
    the host side not pinned, a tensor that is not 2-D with contiguous rows, or
    rows of different widths.

    The caller has checked every row against both tensors (no bounds check
    here), gives index tensors of int64 on the CUDA device, destination rows
    that do not repeat, and synchronises the device before the bytes are read
    or the copy is reported done."""
    if not ENABLED:
        return False
    cuda = dst.device if dst.device.type == "cuda" else src.device
    if cuda.type != "cuda" or not (_side_ok(dst, cuda) and _side_ok(src, cuda)):
        return False
    d = _byte_rows(dst)
    s = _byte_rows(src)
    if d is None or s is None or d[2] != s[2]:
        return False
    kernel = _kernel()
    if kernel is None:
        return False
    row_bytes = d[2]
    if length <= 0 or row_bytes == 0:
        return True
    if callable(dst_rows):
        dst_rows = dst_rows()
    if callable(src_rows):
        src_rows = src_rows()
    block = min(BLOCK_BYTES, 1 << max(8, (row_bytes - 1).bit_length()))
    grid = (length, -(-row_bytes // block))
    try:
        with _launch_lock, torch.cuda.device(cuda):
            kernel[grid](d[0], s[0], dst_rows, src_rows, dst_start, src_start, d[1], s[1],
                         row_bytes, DST_INDEXED=dst_rows is not None,
                         SRC_INDEXED=src_rows is not None, BLOCK=block,
                         num_warps=WARPS)
    except ValueError as exc:
        # Triton's launcher refuses a pointer the device cannot reach (host memory
        # pinned but not mapped for this device) before anything is queued.
        _log.warning("GPU row kernel refused its tensors; this move goes through staging",
                     extra={"device": str(cuda), "reason": str(exc)})
        return False
    return True

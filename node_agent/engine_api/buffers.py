"""Sharing KV buffers between an engine process and the agent without copies.

An engine describes each KV buffer tensor by a *handle*, a JSON object:

* ``{"kind": "shm", "name": ..., "dtype": ..., "shape": [...], "offset": 0}`` for a
  CPU tensor living in POSIX shared memory (tests, the demo, CPU-only engines);
* ``{"kind": "cuda_ipc", "device": ..., "handle": <base64>, ...}`` for a CUDA
  tensor, exported through the CUDA IPC of torch's storage sharing.

The agent has one code path, :func:`open_buffer`, that turns any handle back
into a torch tensor aliasing the engine's memory. The returned
:class:`OpenedBuffer` keeps the mapping alive; ``close`` drops it (the engine
owns and unlinks the memory).
"""

from __future__ import annotations

import base64
import contextlib
import math
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}

# One shared-memory segment may not exceed this (guards against absurd shapes).
MAX_BUFFER_BYTES = 1 << 40


class HandleError(ValueError):
    """A handle cannot be opened; the message names the handle field and the fix."""


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype (``float16``...); raises for unsupported dtypes."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise HandleError(
            f"dtype {dtype} cannot be shared; use one of {', '.join(_DTYPES)}"
        ) from None


def _dtype(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise HandleError(
            f"handle dtype {name!r} is not supported; use one of {', '.join(_DTYPES)}"
        )
    return _DTYPES[name]


def _shape(value: object) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value)
    ):
        raise HandleError(f"handle shape {value!r} must be a non-empty list of positive ints")
    return tuple(value)


@dataclass
class OpenedBuffer:
    """A tensor aliasing an engine's buffer plus what keeps the mapping alive."""

    tensor: torch.Tensor
    _keep: Any = None

    def close(self) -> None:
        """Drop the agent's mapping. The tensor must not be used afterwards."""
        keep, self._keep = self._keep, None
        if isinstance(keep, shared_memory.SharedMemory):
            # Views into the mapping must be gone before the mmap can close.
            self.tensor = torch.empty(0)
            # A view may still be exported somewhere; the mapping is then freed with it.
            with contextlib.suppress(BufferError):
                keep.close()


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(v: object, key: str) -> bytes:
    if not isinstance(v, str):
        raise HandleError(f"handle field {key!r} must be base64 text, got {type(v).__name__}")
    return base64.b64decode(v.encode("ascii"), validate=True)


#: Segments this process created (their owner's tracker entry must stay).
CREATED_HERE: set[str] = set()


def attach_shm(name: str) -> shared_memory.SharedMemory:
    """Attach to an existing segment without handing it to this process's resource
    tracker (which would unlink the engine's memory when this process exits)."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    if shm._name not in CREATED_HERE:  # type: ignore[attr-defined]
        # Best effort: not every platform tracks segments.
        with contextlib.suppress(Exception):
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def open_buffer(handle: object) -> OpenedBuffer:
    """Rebuild a tensor from a handle (the agent's single code path for every kind)."""
    if not isinstance(handle, dict):
        raise HandleError(f"buffer handle must be an object, got {type(handle).__name__}")
    kind = handle.get("kind")
    if kind == "shm":
        return _open_shm(handle)
    if kind == "cuda_ipc":
        return _open_cuda(handle)
    raise HandleError(f"handle kind {kind!r} is unknown; use 'shm' or 'cuda_ipc'")


def _open_shm(h: dict[str, Any]) -> OpenedBuffer:
    name, offset = h.get("name"), h.get("offset", 0)
    if not isinstance(name, str) or not name or len(name) > 255:
        raise HandleError(f"shm handle name {name!r} must be a segment name")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise HandleError(f"shm handle offset {offset!r} must be an int >= 0")
    dtype, shape = _dtype(h.get("dtype")), _shape(h.get("shape"))
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes > MAX_BUFFER_BYTES:
        raise HandleError(f"shm handle of {nbytes} bytes exceeds {MAX_BUFFER_BYTES}")
    try:
        shm = attach_shm(name)
    except FileNotFoundError:
        raise HandleError(
            f"shared memory segment {name!r} does not exist; the engine must keep it "
            "allocated while registered"
        ) from None
    if offset + nbytes > shm.size:
        shm.close()
        raise HandleError(
            f"shm handle {name!r} needs {offset + nbytes} bytes but the segment has {shm.size}"
        )
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return OpenedBuffer(tensor=flat.view(dtype).view(shape), _keep=shm)


def _open_cuda(h: dict[str, Any]) -> OpenedBuffer:
    if not torch.cuda.is_available():
        raise HandleError(
            "cuda_ipc handle received but CUDA is not available to the agent; run the "
            "agent on the GPU node with the NVIDIA runtime, or share CPU buffers (shm)"
        )
    dtype, shape = _dtype(h.get("dtype")), _shape(h.get("shape"))
    stride = h.get("stride")
    if not isinstance(stride, list) or len(stride) != len(shape):
        raise HandleError(f"cuda_ipc handle stride {stride!r} must match shape {list(shape)}")
    storage = torch.UntypedStorage._new_shared_cuda(
        int(h["device"]),
        _unb64(h["handle"], "handle"),
        int(h["storageSize"]),
        int(h["storageOffsetBytes"]),
        _unb64(h["refCounterHandle"], "refCounterHandle"),
        int(h["refCounterOffset"]),
        _unb64(h["eventHandle"], "eventHandle") if h.get("eventHandle") else b"",
        bool(h.get("eventSyncRequired", False)),
    )
    t = torch.empty(0, dtype=dtype, device=storage.device)
    t.set_(storage, int(h.get("tensorOffset", 0)), shape, tuple(int(s) for s in stride))
    return OpenedBuffer(tensor=t, _keep=storage)


def cuda_handle(t: torch.Tensor) -> dict[str, Any]:
    """Export a CUDA tensor as a ``cuda_ipc`` handle (the engine side).

    The engine must keep ``t`` alive while the agent uses it.
    """
    storage = t.untyped_storage()
    (device, handle, size, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()
    )
    return {
        "kind": "cuda_ipc",
        "device": int(device),
        "handle": _b64(handle),
        "storageSize": int(size),
        "storageOffsetBytes": int(offset_bytes),
        "refCounterHandle": _b64(ref_handle),
        "refCounterOffset": int(ref_offset),
        "eventHandle": _b64(event_handle) if event_handle else "",
        "eventSyncRequired": bool(event_sync),
        "dtype": dtype_name(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "tensorOffset": int(t.storage_offset()),
    }

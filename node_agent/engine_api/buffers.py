"""Sharing KV buffers between an engine process and the agent without copies.

An engine describes each KV buffer tensor by a *handle*, a JSON object:

* ``{"kind": "shm", "name": ..., "dtype": ..., "shape": [...], "offset": 0}`` for a
  CPU tensor living in POSIX shared memory (tests, the demo, CPU-only engines);
  ``offset`` is in bytes; an optional ``"stride": [...]`` (in elements) describes
  a strided view, such as one layer of vLLM's KV cache inside its one buffer;
* ``{"kind": "cuda_ipc", "device": ..., "handle": <base64>, ...}`` for a CUDA
  tensor, exported through the CUDA IPC of torch's storage sharing.

The agent has one code path, :func:`open_buffer`, that turns any handle back
into a torch tensor aliasing the engine's memory. The returned
:class:`OpenedBuffer` keeps the mapping alive; ``close`` drops it (the engine
owns and unlinks the memory).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import functools
import math
import mmap
import re
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
    try:
        return base64.b64decode(v.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error) as exc:
        raise HandleError(
            f"handle field {key!r} is not valid base64 ({exc}); send the bytes cuda_handle() "
            "exported, unchanged"
        ) from None


def _int_field(h: dict[str, Any], key: str, lo: int = 0, default: int | None = None) -> int:
    """``h[key]`` as an int >= ``lo``; ``HandleError`` naming the field, the bad value
    and the fix when it is missing (without a default) or of another type."""
    v = h.get(key, default)
    if v is None:
        raise HandleError(f"cuda_ipc handle has no {key!r} field; send the handle "
                          "cuda_handle() exported, unchanged")
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise HandleError(f"cuda_ipc handle field {key!r} is {v!r}; it must be an int >= {lo} "
                          "(send the handle cuda_handle() exported, unchanged)")
    return v


#: Bytes of a ``cudaIpcMemHandle_t`` and of a ``cudaIpcEventHandle_t``.
CUDA_IPC_HANDLE_BYTES = 64
#: Slots (int64 counters) in the reference-counter file torch shares with a CUDA
#: tensor (``CUDA_IPC_REF_COUNTER_FILE_SIZE``); the agent decrements slot
#: ``refCounterOffset`` of that file when it drops the buffer.
REF_COUNTER_SLOTS = 10_000
#: torch's storage-sharing handle: a version byte, a kind byte, then the kind's data.
_KIND_CUDA_MALLOC = ord("c")
_KIND_EXPANDABLE_SEGMENT = ord("e")
#: torch names its counter files ``/torch_<pid>_<random>_<n>``; any other name could
#: be another process's shared memory, which torch would decrement and may unlink.
_REF_COUNTER_NAME = re.compile(rb"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")


def _memory_handle(raw: bytes) -> bytes:
    """The ``handle`` field's bytes, refused unless they are a handle of a plain
    ``cudaMalloc`` block, the one kind torch opens without trusting the bytes.

    torch exports either a raw 64-byte ``cudaIpcMemHandle_t`` (older releases) or
    a version byte and a kind byte followed by the kind's data. Kind ``c`` carries
    the 64-byte handle; kind ``e`` (an expandable segment) carries a header that
    torch divides by and file descriptors it takes from the exporting process, so
    a damaged one can kill the agent (a floating-point exception inside torch)
    and every engine's cache with it. Only ``c`` and the raw form are opened.
    """
    if len(raw) == CUDA_IPC_HANDLE_BYTES:
        return raw
    if len(raw) >= 2 and raw[1] == _KIND_EXPANDABLE_SEGMENT:
        raise HandleError(
            "cuda_ipc handle field 'handle' is an expandable-segment handle; the agent opens "
            "only buffers allocated by plain cudaMalloc. Start the engine without "
            "expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF), "
            "or allocate its KV cache outside torch's expandable segments")
    if len(raw) != CUDA_IPC_HANDLE_BYTES + 2 or raw[1] != _KIND_CUDA_MALLOC or raw[0] == 0:
        raise HandleError(
            f"cuda_ipc handle field 'handle' holds {len(raw)} bytes that are not a torch CUDA "
            f"IPC memory handle ({CUDA_IPC_HANDLE_BYTES} bytes, or a version byte, kind 'c' "
            f"and {CUDA_IPC_HANDLE_BYTES} bytes); send the handle cuda_handle() exported, "
            "unchanged")
    return raw


def _ref_counter_name(raw: bytes) -> bytes:
    """The ``refCounterHandle`` field: the name of torch's shared reference-counter
    file, such as ``/torch_474_3869516404_0``."""
    if not _REF_COUNTER_NAME.fullmatch(raw):
        raise HandleError(
            f"cuda_ipc handle field 'refCounterHandle' is {raw[:64]!r}, not the name of "
            "torch's reference-counter file (/torch_<pid>_<random>_<n>); the agent would "
            "decrement a counter in that shared memory when it drops the buffer. Send the "
            "handle cuda_handle() exported, unchanged")
    return raw


@dataclass(frozen=True)
class CudaHandleFields:
    """A ``cuda_ipc`` handle's fields, checked (no GPU needed to check them)."""

    device: int
    handle: bytes
    storage_size: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    tensor_offset: int


def cuda_handle_fields(h: dict[str, Any]) -> CudaHandleFields:
    """Check every field of a ``cuda_ipc`` handle; ``HandleError`` names the first bad
    one, its value and the fix."""
    dtype, shape = _dtype(h.get("dtype")), _shape(h.get("shape"))
    stride = h.get("stride")
    if (not isinstance(stride, list) or len(stride) != len(shape)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                       for s in stride)):
        raise HandleError(f"cuda_ipc handle stride {stride!r} must be a list of ints >= 0, "
                          f"one per dimension of shape {list(shape)}")
    event = h.get("eventHandle") or ""
    sync = h.get("eventSyncRequired", False)
    if not isinstance(sync, bool):
        raise HandleError(f"cuda_ipc handle field 'eventSyncRequired' is {sync!r}; it must be "
                          "true or false")
    event_bytes = _unb64(event, "eventHandle") if event else b""
    if sync and len(event_bytes) != CUDA_IPC_HANDLE_BYTES:
        raise HandleError(
            f"cuda_ipc handle field 'eventHandle' has {len(event_bytes)} bytes but "
            f"'eventSyncRequired' is true; a CUDA IPC event handle has "
            f"{CUDA_IPC_HANDLE_BYTES} bytes (send the handle cuda_handle() exported, unchanged)")
    ref_counter_offset = _int_field(h, "refCounterOffset")
    if ref_counter_offset >= REF_COUNTER_SLOTS:
        raise HandleError(
            f"cuda_ipc handle field 'refCounterOffset' is {ref_counter_offset}; torch's "
            f"reference-counter file has {REF_COUNTER_SLOTS} slots, so it must be below that "
            "(send the handle cuda_handle() exported, unchanged)")
    return CudaHandleFields(
        device=_int_field(h, "device"),
        handle=_memory_handle(_unb64(h.get("handle"), "handle")),
        storage_size=_int_field(h, "storageSize", lo=1),
        storage_offset_bytes=_int_field(h, "storageOffsetBytes"),
        ref_counter_handle=_ref_counter_name(
            _unb64(h.get("refCounterHandle"), "refCounterHandle")),
        ref_counter_offset=ref_counter_offset,
        event_handle=event_bytes,
        event_sync_required=sync,
        dtype=dtype, shape=shape, stride=tuple(stride),
        tensor_offset=_int_field(h, "tensorOffset", default=0),
    )


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
    itemsize = torch.empty(0, dtype=dtype).element_size()
    stride = _stride(h.get("stride"), shape)
    if stride is None:
        nbytes = math.prod(shape) * itemsize
    else:
        if offset % itemsize:
            raise HandleError(f"shm handle offset {offset} is not a multiple of the "
                              f"{itemsize}-byte dtype {h.get('dtype')}")
        nbytes = (sum((d - 1) * s for d, s in zip(shape, stride, strict=True)) + 1) * itemsize
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
    _populate(shm, offset, nbytes)
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes, offset=offset)
    if stride is None:
        return OpenedBuffer(tensor=flat.view(dtype).view(shape), _keep=shm)
    return OpenedBuffer(tensor=torch.as_strided(flat.view(dtype), shape, stride), _keep=shm)


#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+); Python 3.11's mmap lacks the name.
_MADV_POPULATE_WRITE = 23


def _populate(shm: shared_memory.SharedMemory, offset: int, nbytes: int) -> None:
    """Map the handle's pages into this process now, at registration, rather than
    one page fault at a time during the first copies (best effort: older kernels
    refuse the advice and the pages fault in lazily as before)."""
    mm = getattr(shm, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    page = mmap.PAGESIZE
    start = offset - offset % page
    with contextlib.suppress(OSError, ValueError, OverflowError):
        mm.madvise(_MADV_POPULATE_WRITE, start, min(offset + nbytes, shm.size) - start)


def _stride(value: object, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """An shm handle's optional ``stride``: one int >= 0 per dimension of ``shape``."""
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != len(shape)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                       for s in value)):
        raise HandleError(f"shm handle stride {value!r} must be a list of ints >= 0, one per "
                          f"dimension of shape {list(shape)}")
    return tuple(value)


def _open_cuda(h: dict[str, Any]) -> OpenedBuffer:
    f = cuda_handle_fields(h)
    if not torch.cuda.is_available():
        raise HandleError(
            "cuda_ipc handle received but CUDA is not available to the agent; run the "
            "agent on the GPU node with the NVIDIA runtime, or share CPU buffers (shm)"
        )
    if f.device >= torch.cuda.device_count():
        raise HandleError(
            f"cuda_ipc handle names device {f.device} but the agent sees "
            f"{torch.cuda.device_count()} CUDA device(s); give the agent every GPU of the node "
            "and the same CUDA_VISIBLE_DEVICES order as the engine")
    try:
        # torch opens IPC handles only after its CUDA state is set up (its own
        # rebuild path does the same); without it a refused handle can crash.
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(
            f.device, f.handle, f.storage_size, f.storage_offset_bytes,
            f.ref_counter_handle, f.ref_counter_offset, f.event_handle, f.event_sync_required,
        )
        _check_inside_allocation(storage, f)
        t = torch.empty(0, dtype=f.dtype, device=storage.device)
        t.set_(storage, f.tensor_offset, f.shape, f.stride)
    except HandleError:
        raise
    except (RuntimeError, ValueError, TypeError, SystemError) as exc:
        raise HandleError(
            f"cuda_ipc handle for device {f.device} ({f.storage_size} bytes) cannot be opened: "
            f"{exc}; the exporting engine must keep the tensor alive and run on this node"
        ) from exc
    return OpenedBuffer(tensor=t, _keep=storage)


def _check_inside_allocation(storage: torch.UntypedStorage, f: CudaHandleFields) -> None:
    """Refuse a handle whose ``storageOffsetBytes`` + ``storageSize`` reach past the
    allocation it exported: copies through it would read or write memory the engine
    never shared (another tensor's or another engine's, or none, which faults the
    agent's CUDA context). The allocation is the one torch mapped for the handle,
    found from the mapped base (the storage's address less its offset), so an
    offset that lands inside some other allocation of the agent is refused too."""
    mapped = storage.data_ptr() - f.storage_offset_bytes
    base, size = _address_range(mapped, f.device)
    if base != mapped or f.storage_offset_bytes + f.storage_size > size:
        held = ("no allocation at its mapped base" if base is None else
                f"an allocation of {size} bytes" if base == mapped else
                "not the start of an allocation")
        raise HandleError(
            f"cuda_ipc handle claims {f.storage_size} bytes at storage offset "
            f"{f.storage_offset_bytes} on device {f.device}, but the exported memory is "
            f"{held}; send the handle cuda_handle() exported, unchanged")


#: ``CUDA_ERROR_NOT_FOUND``: ``cuMemGetAddressRange`` of an address in no allocation.
_CUDA_ERROR_NOT_FOUND = 500


@functools.cache
def _libcuda() -> ctypes.CDLL:
    """The CUDA driver library, loaded once."""
    return ctypes.CDLL("libcuda.so.1")


def _address_range(ptr: int, device: int) -> tuple[int | None, int]:
    """``(base, size)`` of the device allocation holding ``ptr`` (the driver's
    ``cuMemGetAddressRange``), or ``(None, 0)`` when ``ptr`` is in none.
    ``HandleError`` when the driver cannot be asked or answers another error."""
    try:
        get_range = _libcuda().cuMemGetAddressRange_v2
    except (OSError, AttributeError) as exc:
        raise HandleError(
            f"cuda_ipc handle cannot be checked: the CUDA driver library is not usable "
            f"({exc}); run the agent with the NVIDIA runtime") from exc
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(device):
        # A runtime call that needs the device's context binds it to this thread
        # (a pool thread may have none yet); the driver call below needs it.
        torch.cuda.current_stream(device).query()
        rc = int(get_range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)))
    if rc == _CUDA_ERROR_NOT_FOUND:
        return None, 0
    if rc != 0:
        raise HandleError(
            f"cuda_ipc handle cannot be checked: cuMemGetAddressRange answered CUDA error "
            f"{rc} on device {device}; the exporting engine must run on this node")
    return int(base.value), int(size.value)


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

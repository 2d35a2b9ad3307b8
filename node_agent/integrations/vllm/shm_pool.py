"""Placing vLLM's KV cache in POSIX shared memory, so the agent maps it without a copy.

vLLM allocates the whole KV cache of a worker as one ``torch.zeros(n, dtype=int8)``
inside the connector's ``get_mem_pool_context()``. :class:`SharedKVAllocation` is
that context on CPU: a ``TorchFunctionMode`` that turns the first large
``torch.zeros`` / ``torch.empty`` on the CPU into a tensor backed by a new
``/dev/shm`` segment, and leaves every other call alone. The agent then opens
each layer's view by segment name, offset and strides (``node_agent.engine_api.buffers``).

The creating process owns the segment: :meth:`SharedKVAllocation.close` unlinks
it, and Python's resource tracker unlinks it if the process dies first.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from node_agent.engine_api.buffers import CREATED_HERE

#: Allocations below this many bytes are left to torch (vLLM's KV cache is far larger).
MIN_BYTES = 1 << 20


class SharedKVAllocation(TorchFunctionMode):
    """Context manager: the next large CPU ``zeros``/``empty`` lands in shared memory."""

    def __init__(self, prefix: str = "flexkv-vllm") -> None:
        super().__init__()
        self.prefix = prefix
        self.segment: shared_memory.SharedMemory | None = None
        self.tensor: torch.Tensor | None = None

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.segment is None and func in (torch.zeros, torch.empty):
            shared = self._maybe_shared(func, args, kwargs)
            if shared is not None:
                return shared
        return func(*args, **kwargs)

    def _maybe_shared(self, func: Callable[..., Any], args: Any,
                      kwargs: dict[str, Any]) -> torch.Tensor | None:
        size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        if not size or not all(isinstance(d, int) for d in size):
            return None
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        device = torch.device(kwargs.get("device") or "cpu")
        if device.type != "cpu" or kwargs.get("out") is not None:
            return None
        nbytes = math.prod(size) * torch.empty(0, dtype=dtype).element_size()
        if nbytes < MIN_BYTES:
            return None
        name = f"{self.prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        seg = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        CREATED_HERE.add(seg._name)  # type: ignore[attr-defined]
        self.segment = seg
        t = torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes).view(dtype).view(size)
        # A fresh segment reads as zeros; fault its pages in now, as torch.zeros would.
        t.zero_()
        self.tensor = t
        return t

    @property
    def name(self) -> str | None:
        """The segment's name (``None`` until the allocation happened)."""
        return None if self.segment is None else self.segment.name

    def close(self) -> None:
        """Unlink the segment (the engine's tensors must be gone or unused)."""
        seg, self.segment = self.segment, None
        self.tensor = None
        if seg is None:
            return
        with contextlib.suppress(BufferError):
            seg.close()
        with contextlib.suppress(FileNotFoundError):
            seg.unlink()
        CREATED_HERE.discard(seg._name)  # type: ignore[attr-defined]

"""The KV cache a worker registered, for the scheduler side's loads on the same host.

vLLM runs the scheduler side in its engine-core process and each worker in its
own process. With one worker (``tensor_parallel_size`` and
``pipeline_parallel_size`` 1) and a CPU KV cache in shared memory, the worker
publishes the ``shm`` handles it registered with the agent in a small file named
by the engine's ``engine_id`` (``/dev/shm/flexkv-vllm-kv-<engine_id>.json``);
the scheduler side opens the same memory (``engine_api.buffers.open_buffer``,
the agent's own code path) and copies a claimed hit into it itself
(:class:`node_agent.engine_loads.EngineLoads`) instead of waiting for the
agent's copy. The worker removes the file when it shuts down.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from node_agent.engine_api.buffers import OpenedBuffer, open_buffer
from node_agent.engine_api.protocol import layout_to_wire, parse_layout
from node_agent.vocab.layout import KVLayout

SHM_DIR = Path("/dev/shm")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def path_for(engine_id: str, directory: Path = SHM_DIR) -> Path:
    """Where the worker of engine ``engine_id`` publishes its KV cache handles."""
    return directory / f"flexkv-vllm-kv-{_SAFE.sub('_', engine_id)[:128]}.json"


def publish(engine_id: str, layout: KVLayout, handles: list[dict[str, Any]],
            directory: Path = SHM_DIR) -> Path:
    """Publish the worker's KV cache (its layout and the ``shm`` handles it
    registered) for the scheduler side of the same engine; written atomically."""
    path = path_for(engine_id, directory)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"layout": layout_to_wire(layout), "handles": handles}, f)
    os.replace(tmp, path)
    return path


def withdraw(engine_id: str, directory: Path = SHM_DIR) -> None:
    """The worker shuts down: its KV cache is no longer to be copied into."""
    with contextlib.suppress(FileNotFoundError):
        path_for(engine_id, directory).unlink()


@dataclass
class LocalKV:
    """A worker's KV cache opened in this process: its layout and layer tensors."""

    layout: KVLayout
    tensors: list[torch.Tensor]
    _opened: list[OpenedBuffer] = field(default_factory=list)

    def close(self) -> None:
        """Drop this process's mappings (the tensors must not be used afterwards)."""
        opened, self._opened = self._opened, []
        self.tensors = []
        for b in opened:
            b.close()


def find(engine_id: str, directory: Path = SHM_DIR) -> LocalKV | None:
    """Open the KV cache the worker of ``engine_id`` published, or None when there is
    none (another executor, a GPU cache, the worker not registered yet). Raises
    ``ValueError`` (a ``HandleError``) for a published file that cannot be used."""
    try:
        raw = json.loads(path_for(engine_id, directory).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"the KV cache published for engine {engine_id} cannot be read: "
                         f"{exc}") from exc
    layout = parse_layout(raw["layout"])
    opened: list[OpenedBuffer] = []
    try:
        for h in raw["handles"]:
            # Not through the resource tracker, which vLLM's worker may share with
            # this process: attaching there would drop the worker's own entry.
            opened.append(open_buffer(h, tracked=False))
    except BaseException:
        for b in opened:
            b.close()
        raise
    return LocalKV(layout, [b.tensor for b in opened], opened)

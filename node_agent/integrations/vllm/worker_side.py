"""The worker half of the vLLM connector: registering this rank's KV cache.

vLLM hands ``register_kv_caches`` one tensor per attention layer. Two forms:

* ``[num_blocks, heads, block_size, kv_dim * head_size]`` (vLLM 0.32's paged
  views, the CPU form: K and V packed in the last axis; views of one buffer,
  possibly with layers interleaved) -> the agent's ``layer_block_head_token_kv``;
* ``[2, num_blocks, block_size, heads, head_size]`` (flash-attention's form on
  GPUs) -> viewed as ``[2, num_blocks * block_size, heads, head_size]``, the
  agent's ``layer_kv_slot_head``.

On CPU the buffer lives in shared memory (:mod:`.shm_pool`), so each layer is
sent as an ``shm`` handle with its byte offset and strides; CUDA tensors go as
CUDA IPC handles. Either way the agent maps the engine's own memory: no copy.

The agent forgets registrations when it restarts. :class:`Registrar` notices a
new agent by the identity of its socket file (inode and change time) and
registers again, checked at most every ``RECHECK_SECONDS`` from the step hooks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from node_agent.client import AGENT_ERRORS, AgentUnavailableError, EngineClient, RankInfo
from node_agent.engine_api.buffers import cuda_handle, dtype_name
from node_agent.integrations.vllm.config import AgentConnectorConfig, ConnectorConfigError
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName

log = logging.getLogger(__name__)

RECHECK_SECONDS = 0.5
#: In the agent's refusal of a layout whose tokens per block are not the pool's.
BLOCK_SIZE_REFUSAL = "differs from the pool's tokensPerBlock"


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor], block_size: int, head_size: int,
                       tp_size: int) -> tuple[KVLayout, list[torch.Tensor]]:
    """The agent layout of vLLM's per-layer KV tensors and the tensors to register
    (views, never copies). Raises ``ValueError`` naming the tensor and the problem."""
    seen: set[tuple[int, int]] = set()
    tensors: list[torch.Tensor] = []
    for name, t in kv_caches.items():
        key = (t.data_ptr(), int(t.storage_offset()))
        if key in seen:  # a layer sharing another layer's cache
            continue
        seen.add(key)
        if t.dim() == 4:
            heads, n, c = t.shape[1:]
            form = LayoutName.LAYER_BLOCK_HEAD_TOKEN_KV
        elif t.dim() == 5 and t.shape[0] == 2:
            _, nb, n, heads, c = t.shape
            t = t.view(2, nb * n, heads, c)  # raises rather than copy
            c *= 2
            form = LayoutName.LAYER_KV_SLOT_HEAD
        else:
            raise ValueError(f"KV cache of layer {name} has shape {tuple(t.shape)}; the FlexKV "
                             "connector takes [num_blocks, heads, block_size, 2 * head_size] or "
                             "[2, num_blocks, block_size, heads, head_size]")
        if n != block_size:
            raise ValueError(f"KV cache of layer {name} has {n} tokens per block but vLLM's "
                             f"block_size is {block_size}; use a block size the attention "
                             "backend does not split into kernel blocks")
        if c != 2 * head_size:
            raise ValueError(f"KV cache of layer {name} holds {c} values per token and head, "
                             f"expected K and V of head_size {head_size} (MLA is not supported)")
        tensors.append(t)
        if tensors[0].dim() != t.dim():
            raise ValueError(f"KV cache of layer {name} has another form than the first layer's")
    if not tensors:
        raise ValueError("vLLM registered no KV cache tensors")
    first = tensors[0]
    heads = first.shape[1] if form.paged else first.shape[2]
    layout = KVLayout(num_layers=len(tensors), num_kv_heads=heads * tp_size,
                      head_size=head_size, kv_dim=2, dtype=KVDtype.parse(first.dtype),
                      tokens_per_block=block_size, tp_size=tp_size, name=form)
    return layout, tensors


def shm_handles(tensors: list[torch.Tensor], segment: str, base: torch.Tensor,
                ) -> list[dict[str, Any]]:
    """``shm`` handles for views of ``base`` (the tensor backed by ``segment``)."""
    base_ptr = base.untyped_storage().data_ptr()
    out = []
    for t in tensors:
        if t.untyped_storage().data_ptr() != base_ptr:
            raise ValueError("a KV cache tensor does not live in the shared-memory segment; "
                             "vLLM allocated it outside the connector's get_mem_pool_context")
        out.append({"kind": "shm", "name": segment, "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape), "stride": list(t.stride()),
                    "offset": t.storage_offset() * t.element_size()})
    return out


def _socket_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path.removeprefix("ipc://"))
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


class Registrar:
    """Registers one rank's KV cache with the agent, and again after an agent restart."""

    def __init__(self, cfg: AgentConnectorConfig, rank: RankInfo, layout: KVLayout,
                 handles: list[dict[str, Any]], block_size: int,
                 socket: str | None = None) -> None:
        self.cfg = cfg
        self.socket = socket or cfg.socket_for(rank.pp_rank)
        """This rank's agent socket (its PP stage's, :meth:`AgentConnectorConfig.socket_for`)."""
        self.layout = layout
        self.handles = handles
        self.block_size = block_size
        self.client = EngineClient(self.socket, rank, timeout=cfg.call_timeout_seconds)
        self._identity: tuple[int, int] | None = None
        self._next_check = 0.0
        self.registrations = 0

    def register(self, at_start: bool) -> bool:
        """Register; at start-up a refusal (bad layout, block size) raises, as does a
        missing agent when ``requireAgent`` is set. Later failures only log."""
        identity = _socket_identity(self.socket)
        try:
            self.client.register_kv_buffers(self.layout, [self.handles])
        except ValueError as exc:
            # The agent's message names the fix; a block size refusal also gets vLLM's flag.
            hint = (". vLLM's --block-size must equal the pool's tokensPerBlock"
                    if BLOCK_SIZE_REFUSAL in str(exc) else "")
            raise ConnectorConfigError(
                f"the FlexKV agent at {self.socket} refused vLLM's KV cache "
                f"(vLLM block_size={self.block_size}, layout {self.layout.name.value}): {exc}"
                f"{hint}"
            ) from exc
        except AGENT_ERRORS as exc:
            if at_start and self.cfg.require_agent:
                raise ConnectorConfigError(
                    f"no FlexKV agent answers at kv_connector_extra_config.engineSocket="
                    f"{self.socket!r} ({exc}); start the agent, point engineSocket "
                    "at its socket, or set requireAgent to false to start without it"
                ) from exc
            level = logging.WARNING if at_start else logging.DEBUG
            log.log(level, "FlexKV agent not reachable, KV cache not registered yet: %s", exc)
            self._identity = None
            return False
        self._identity = identity
        self.registrations += 1
        if self.registrations > 1:
            log.warning("FlexKV agent restarted, KV cache registered again")
        return True

    def check(self) -> None:
        """Re-register when the agent's socket changed (a restarted agent); cheap: a
        ``stat`` at most every ``RECHECK_SECONDS``."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + RECHECK_SECONDS
        identity = _socket_identity(self.socket)
        if identity is not None and identity != self._identity:
            try:
                self.register(at_start=False)
            except ConnectorConfigError as exc:
                log.warning("FlexKV agent refused the KV cache: %s", exc)
                self._identity = identity  # do not retry a refusal every step

    def close(self) -> None:
        self.client.close()


def cuda_handles(tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
    """CUDA IPC handles of the layer tensors (the agent maps them on the same GPU)."""
    return [cuda_handle(t) for t in tensors]


__all__ = ["AgentUnavailableError", "Registrar", "describe_kv_caches", "shm_handles"]

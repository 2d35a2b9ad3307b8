"""SGLang's KV pool as the agent's :class:`~node_agent.vocab.layout.KVLayout`.

SGLang 0.5.23's token-to-KV pools (``sglang/srt/mem_cache/memory_pool.py``)
keep one tensor per layer: ``MHATokenToKVPool`` has ``k_buffer`` and ``v_buffer``
(``(slots, heads, head_dim)`` each), ``MLATokenToKVPool`` has ``kv_buffer``
(``(slots, 1, kv_lora_rank + qk_rope_head_dim)``). SGLang's FlexKV connector
registers exactly these lists (``FlexKVConnector.__init__``: ``kv_buffer``, else
``k_buffer + v_buffer``); the agent takes them as ``layer_slot_head`` buffers.
No SGLang import: the pool is read through those attributes.
"""

from __future__ import annotations

from typing import Any

import torch

from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName


def layout_from_kv_pool(pool: Any, page_size: int, tp_size: int = 1,
                        ) -> tuple[KVLayout, list[list[torch.Tensor]]]:
    """The stage's layout and the buffers to register, from SGLang's KV pool.

    Raises ``ValueError`` naming the problem for a pool the agent cannot serve
    (no per-layer buffers, mixed shapes, an unsupported dtype such as fp8)."""
    if hasattr(pool, "kv_buffer"):
        groups = [list(pool.kv_buffer)]
    elif hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        groups = [list(pool.k_buffer), list(pool.v_buffer)]
    else:
        raise ValueError(
            f"KV pool {type(pool).__name__} has neither kv_buffer (MLA) nor k_buffer/v_buffer "
            "(MHA); the flexkv-agent backend serves SGLang's MHA and MLA token pools only"
        )
    first = groups[0][0] if groups[0] else None
    if first is None or first.dim() != 3:
        raise ValueError(
            f"KV pool {type(pool).__name__} buffers must be one 3-D tensor per layer "
            f"(slots, heads, head_dim); got {None if first is None else tuple(first.shape)}"
        )
    for group in groups:
        for t in group:
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
                raise ValueError(
                    f"KV pool layers differ: {tuple(t.shape)} {t.dtype} vs "
                    f"{tuple(first.shape)} {first.dtype}; every layer must have one shape"
                )
    try:
        dtype = KVDtype.parse(first.dtype)
    except ValueError as exc:
        raise ValueError(f"{exc}; run SGLang with --kv-cache-dtype auto (bf16/fp16)") from None
    _, heads, head_dim = (int(x) for x in first.shape)
    mla = len(groups) == 1
    layout = KVLayout(num_layers=len(groups[0]), num_kv_heads=heads if mla else heads * tp_size,
                      head_size=head_dim, kv_dim=1 if mla else 2, dtype=dtype,
                      tokens_per_block=page_size, tp_size=tp_size,
                      name=LayoutName.LAYER_SLOT_HEAD)
    return layout, groups

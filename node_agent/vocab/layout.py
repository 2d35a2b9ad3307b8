"""The KV layout of one PP stage: the shape every layer of the agent speaks.

A :class:`KVLayout` describes the KV cache of the layers this stage holds:
``num_layers x kv_dim x heads x head_size x dtype`` per token, cut into blocks of
``tokens_per_block`` tokens. Everything that sizes a tier (bytes per block) comes
from it, so the engine API, the coordinator, the backends, the client and both
engine integrations share one description.

How a rank's buffers are arranged (:class:`LayoutName`) and how they are
registered as planes: :mod:`node_agent.backend.planes`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class KVDtype(enum.Enum):
    """Element type of the KV buffers."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The matching torch dtype."""
        return _TORCH_DTYPES[self]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _TORCH_DTYPES[self].itemsize

    @classmethod
    def parse(cls, value: str | torch.dtype | KVDtype) -> KVDtype:
        """Accept a name (``"bfloat16"``, ``"bf16"``...) or a torch dtype."""
        if isinstance(value, KVDtype):
            return value
        if isinstance(value, torch.dtype):
            for k, v in _TORCH_DTYPES.items():
                if v == value:
                    return k
            raise ValueError(
                f"KV dtype {value} is not supported; use one of "
                f"{[d.value for d in cls]}"
            )
        name = _ALIASES.get(str(value).lower(), str(value).lower())
        try:
            return cls(name)
        except ValueError:
            raise ValueError(
                f"KV dtype {value!r} is not supported; use one of {[d.value for d in cls]}"
            ) from None


_TORCH_DTYPES = {
    KVDtype.BFLOAT16: torch.bfloat16,
    KVDtype.FLOAT16: torch.float16,
    KVDtype.FLOAT32: torch.float32,
}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}


class LayoutName(enum.Enum):
    """How a rank's KV buffers are arranged (:mod:`node_agent.backend.planes`)."""

    LAYER_SLOT_HEAD = "layer_slot_head"
    LAYER_KV_SLOT_HEAD = "layer_kv_slot_head"
    LAYER_BLOCK_HEAD_TOKEN_KV = "layer_block_head_token_kv"

    @property
    def paged(self) -> bool:
        """True when planes are rows of whole pages (copied by page only)."""
        return self is LayoutName.LAYER_BLOCK_HEAD_TOKEN_KV


@dataclass(frozen=True)
class KVLayout:
    """KV shape of one PP stage (its layers) on one node, and its block size.

    ``num_kv_heads`` counts all KV heads of the stage across TP ranks (1 for MLA);
    ``head_size`` is the per-head dimension (for MLA the latent width,
    ``kv_lora_rank + qk_rope_head_dim``).
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_dim: int = 2
    dtype: KVDtype = KVDtype.BFLOAT16
    tokens_per_block: int = 16
    tp_size: int = 1
    name: LayoutName = LayoutName.LAYER_SLOT_HEAD

    def __post_init__(self) -> None:
        for key in ("num_layers", "num_kv_heads", "head_size", "tokens_per_block", "tp_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{key}={value!r} is invalid; it must be an int >= 1")
        if self.kv_dim not in (1, 2):
            raise ValueError(
                f"KVLayout.kv_dim={self.kv_dim!r} is invalid; use 2 for K and V (MHA/GQA) "
                "or 1 for one combined latent (MLA)"
            )
        if not isinstance(self.dtype, KVDtype):
            object.__setattr__(self, "dtype", KVDtype.parse(self.dtype))
        if not isinstance(self.name, LayoutName):
            try:
                object.__setattr__(self, "name", LayoutName(self.name))
            except ValueError:
                raise ValueError(
                    f"KVLayout.name={self.name!r} is unknown; use one of "
                    f"{[n.value for n in LayoutName]}"
                ) from None
        if not self.is_mla and self.num_kv_heads % self.tp_size:
            raise ValueError(
                f"KVLayout.num_kv_heads={self.num_kv_heads} is not divisible by "
                f"tp_size={self.tp_size}; each TP rank must hold a whole number of heads"
            )

    @property
    def is_mla(self) -> bool:
        """True for a combined latent cache (``kv_dim == 1``), replicated across TP ranks."""
        return self.kv_dim == 1

    @property
    def heads_per_rank(self) -> int:
        """KV heads one TP rank holds."""
        return self.num_kv_heads if self.is_mla else self.num_kv_heads // self.tp_size

    @property
    def num_planes(self) -> int:
        """Planes per rank: one per layer and per K/V (``plane = layer * kv_dim + kv``),
        or one per layer for a paged layout (K and V packed in each page)."""
        return self.num_layers if self.name.paged else self.num_layers * self.kv_dim

    @property
    def row_elems(self) -> int:
        """Elements of one token in one plane of one rank (for a paged layout, a
        page's elements divided by ``tokens_per_block``)."""
        packed = self.kv_dim if self.name.paged else 1
        return self.heads_per_rank * self.head_size * packed

    @property
    def row_bytes(self) -> int:
        """Bytes of one token in one plane of one rank."""
        return self.row_elems * self.dtype.itemsize

    @property
    def stored_ranks(self) -> int:
        """Ranks whose bytes a block holds: all TP ranks, or 1 for MLA (replicated)."""
        return 1 if self.is_mla else self.tp_size

    @property
    def segment_bytes(self) -> int:
        """Bytes of one plane of one rank within one block."""
        return self.row_bytes * self.tokens_per_block

    @property
    def bytes_per_block(self) -> int:
        """Bytes one cache block occupies in a tier (all stored ranks, all planes)."""
        return self.segment_bytes * self.num_planes * self.stored_ranks

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes per token of this stage."""
        return self.bytes_per_block // self.tokens_per_block

"""The KV layout of one PP stage and the engine buffers its ranks register.

A :class:`KVLayout` describes the KV cache of the layers this stage holds:
``num_layers x kv_dim x heads x head_size x dtype`` per token, cut into blocks of
``tokens_per_block`` tokens. Everything that sizes a tier (bytes per block) comes
from it, so the flexkv adapter, the embedded backend and the agent service share
one description.

Buffer layouts (:class:`LayoutName`), named by dimension order:

``layer_slot_head`` (SGLang's ``MHATokenToKVPool`` / ``MLATokenToKVPool``)
    One tensor per layer and per K/V: MHA registers ``(k_buffer, v_buffer)``,
    two lists of ``num_layers`` tensors of shape ``(num_slots, heads, head_size)``;
    MLA registers ``(kv_buffer,)``, one list of ``num_layers`` tensors of shape
    ``(num_slots, 1, kv_lora_rank + qk_rope_head_dim)``.
``layer_kv_slot_head``
    One tensor per layer of shape ``(kv_dim, num_slots, heads, head_size)`` (K
    and V stacked in front, as vLLM's flash-attention layout flattened to slots);
    registered as ``(layers,)``, one list of ``num_layers`` tensors.
``layer_block_head_token_kv`` (vLLM's paged KV cache, its CPU form)
    One tensor per layer of shape ``(num_blocks, heads, tokens_per_block,
    kv_dim * head_size)`` (K and V packed in the last axis), registered as
    ``(layers,)``. The tensors may be strided views of one buffer (vLLM
    interleaves layers), but each ``(layer, block)`` page must be one dense run
    of bytes. A plane is a whole layer (``num_planes == num_layers``), viewed as
    ``(num_blocks, page_elems)``: this layout is copied by whole pages only, so
    slot mappings must cover whole, aligned blocks (slot ``block * tpb + offset``).

The first two normalise to the same internal form, :class:`RegisteredBuffers`: one 2-D
view ``(num_slots, heads * head_size)`` per *plane*, plane ``layer * kv_dim + kv``.
Every copy works on planes with device-agnostic torch ops, so CUDA buffers (GPU
nodes) and CPU tensors in shared memory (CPU nodes, tests) take one code path.

Tensor parallelism: each TP rank registers its own buffers, holding
``num_kv_heads // tp_size`` heads. With MLA (``kv_dim == 1``) every rank holds
the same latent cache, so only rank 0's copy is stored and loads write it into
every rank.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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
    """How a rank's KV buffers are arranged; see the module docstring."""

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


@dataclass(frozen=True)
class RegisteredBuffers:
    """One rank's engine KV buffers, normalised to planes.

    ``planes[p]`` is a view of shape ``(num_slots, layout.row_elems)`` of the
    engine's own memory (no copy): writing into it writes the engine's cache.
    """

    rank: int
    planes: tuple[torch.Tensor, ...]
    num_slots: int
    device: torch.device
    paged: bool = False
    """Planes are ``(num_blocks, page_elems)`` rows of whole pages (copied by page only)."""


def register_buffers(
    layout: KVLayout, rank: int, buffers: Sequence[Sequence[torch.Tensor]]
) -> RegisteredBuffers:
    """Validate one rank's buffers against ``layout`` and normalise them to planes.

    ``buffers`` follows ``layout.name`` (module docstring). Raises ``ValueError``
    naming the offending list, index, shape, dtype or device, and the expected one.
    Every tensor must be on one device, with the layout's dtype, the same slot
    count, and a unit stride on its last dimension (a view of the engine's memory
    is fine; a copy would silently not be the engine's cache).
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < layout.tp_size:
        raise ValueError(
            f"rank={rank!r} is out of range; expected an int in [0, {layout.tp_size}) "
            "(KVLayout.tp_size)"
        )
    groups = list(buffers)
    if layout.name.paged:
        return _register_paged(layout, rank, groups)
    if layout.name is LayoutName.LAYER_SLOT_HEAD:
        if len(groups) != layout.kv_dim:
            raise ValueError(
                f"rank {rank}: got {len(groups)} buffer lists, expected {layout.kv_dim} "
                f"({'(k_buffer, v_buffer)' if layout.kv_dim == 2 else '(kv_buffer,)'}) "
                "for layout layer_slot_head"
            )
        expected_tail = (layout.heads_per_rank, layout.head_size)
        per_layer: list[list[torch.Tensor]] = []
        for g, group in enumerate(groups):
            tensors = list(group)
            if len(tensors) != layout.num_layers:
                raise ValueError(
                    f"rank {rank}: buffer list {g} holds {len(tensors)} tensors, expected "
                    f"num_layers={layout.num_layers}"
                )
            per_layer.append(tensors)
        raw = [
            (f"buffers[{kv}][{layer}]", per_layer[kv][layer])
            for layer in range(layout.num_layers)
            for kv in range(layout.kv_dim)
        ]
        num_slots = _check_tensors(layout, rank, raw, expected_tail, slot_dim=0)
        planes = tuple(t.view(num_slots, layout.row_elems) for _, t in raw)
    else:
        if len(groups) != 1:
            raise ValueError(
                f"rank {rank}: got {len(groups)} buffer lists, expected 1 (one tensor per "
                "layer) for layout layer_kv_slot_head"
            )
        tensors = list(groups[0])
        if len(tensors) != layout.num_layers:
            raise ValueError(
                f"rank {rank}: got {len(tensors)} layer tensors, expected "
                f"num_layers={layout.num_layers}"
            )
        raw = [(f"buffers[0][{i}]", t) for i, t in enumerate(tensors)]
        expected_tail = (layout.heads_per_rank, layout.head_size)
        num_slots = _check_tensors(layout, rank, raw, expected_tail, slot_dim=1)
        planes = tuple(
            t[kv].view(num_slots, layout.row_elems) for _, t in raw for kv in range(layout.kv_dim)
        )
    return RegisteredBuffers(rank=rank, planes=planes, num_slots=num_slots,
                             device=planes[0].device)


def _register_paged(layout: KVLayout, rank: int,
                    groups: list[Sequence[torch.Tensor]]) -> RegisteredBuffers:
    """``layer_block_head_token_kv``: one ``(num_blocks, heads, tpb, kv_dim * head_size)``
    tensor per layer, each page dense; planes are ``(num_blocks, page_elems)`` views."""
    if len(groups) != 1:
        raise ValueError(
            f"rank {rank}: got {len(groups)} buffer lists, expected 1 (one tensor per layer) "
            "for layout layer_block_head_token_kv"
        )
    tensors = list(groups[0])
    if len(tensors) != layout.num_layers:
        raise ValueError(f"rank {rank}: got {len(tensors)} layer tensors, expected "
                         f"num_layers={layout.num_layers}")
    tpb = layout.tokens_per_block
    tail = (layout.heads_per_rank, tpb, layout.kv_dim * layout.head_size)
    page = tail[0] * tail[1] * tail[2]
    device: torch.device | None = None
    num_blocks: int | None = None
    planes = []
    for i, t in enumerate(tensors):
        name = f"buffers[0][{i}]"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"rank {rank}: {name} is a {type(t).__name__}, expected a "
                             "torch.Tensor")
        if t.dtype != layout.dtype.torch_dtype:
            raise ValueError(f"rank {rank}: {name} has dtype {t.dtype}, expected "
                             f"{layout.dtype.torch_dtype} (KVLayout.dtype={layout.dtype.value})")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"rank {rank}: {name} is on {t.device} but earlier buffers are on "
                             f"{device}; all of one rank's buffers must be on one device")
        if t.dim() != 4 or tuple(t.shape[1:]) != tail or t.shape[0] < 1:
            raise ValueError(
                f"rank {rank}: {name} has shape {tuple(t.shape)}, expected (num_blocks, "
                f"{tail[0]}, {tail[1]}, {tail[2]}) (heads_per_rank, tokens_per_block, "
                "kv_dim * head_size)"
            )
        if num_blocks is None:
            num_blocks = int(t.shape[0])
        elif t.shape[0] != num_blocks:
            raise ValueError(f"rank {rank}: {name} has {t.shape[0]} blocks but earlier buffers "
                             f"have {num_blocks}; every layer must hold the same blocks")
        inner = sorted(zip(t.stride()[1:], t.shape[1:], strict=True))
        expect = 1
        for stride, size in inner:
            if stride != expect:
                raise ValueError(
                    f"rank {rank}: {name} has strides {tuple(t.stride())}; each block's page "
                    f"of {page} elements must be one dense run (a page may not be padded or "
                    "interleaved with another layer's)"
                )
            expect *= size
        planes.append(torch.as_strided(t, (num_blocks, page), (t.stride(0), 1),
                                       t.storage_offset()))
    assert device is not None and num_blocks is not None
    return RegisteredBuffers(rank=rank, planes=tuple(planes), num_slots=num_blocks * tpb,
                             device=device, paged=True)


def _check_tensors(
    layout: KVLayout,
    rank: int,
    named: list[tuple[str, torch.Tensor]],
    tail: tuple[int, int],
    slot_dim: int,
) -> int:
    """Check dtype, device, shape and slot count of every tensor; return the slot count."""
    device: torch.device | None = None
    num_slots: int | None = None
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"rank {rank}: {name} is a {type(t).__name__}, expected a torch.Tensor"
            )
        if t.dtype != layout.dtype.torch_dtype:
            raise ValueError(
                f"rank {rank}: {name} has dtype {t.dtype}, expected "
                f"{layout.dtype.torch_dtype} (KVLayout.dtype={layout.dtype.value})"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(
                f"rank {rank}: {name} is on {t.device} but earlier buffers are on {device}; "
                "all of one rank's buffers must be on one device"
            )
        expected_ndim = 3 if slot_dim == 0 else 4
        shape = tuple(t.shape)
        lead_ok = slot_dim == 0 or (len(shape) == 4 and shape[0] == layout.kv_dim)
        if len(shape) != expected_ndim or shape[-2:] != tail or not lead_ok:
            want = ("(num_slots, " if slot_dim == 0 else f"({layout.kv_dim}, num_slots, ") + (
                f"{tail[0]}, {tail[1]})"
            )
            raise ValueError(
                f"rank {rank}: {name} has shape {shape}, expected {want} "
                f"(heads_per_rank={layout.heads_per_rank}, head_size={layout.head_size})"
            )
        slots = shape[slot_dim]
        if slots < 1:
            raise ValueError(f"rank {rank}: {name} has {slots} slots; it must hold at least 1")
        if num_slots is None:
            num_slots = slots
        elif slots != num_slots:
            raise ValueError(
                f"rank {rank}: {name} has {slots} slots but earlier buffers have {num_slots}; "
                "every buffer of a rank must hold the same slots"
            )
        if t.stride(-1) != 1 or t.stride(-2) != tail[1]:
            raise ValueError(
                f"rank {rank}: {name} has strides {tuple(t.stride())}; each slot's "
                "(heads, head_size) must be contiguous"
            )
    assert num_slots is not None and device is not None
    return num_slots

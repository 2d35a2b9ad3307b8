"""The engine buffers a PP stage's ranks register, normalised to planes.

The stage's shape is a :class:`~node_agent.vocab.layout.KVLayout`.

Buffer layouts (:class:`~node_agent.vocab.layout.LayoutName`), named by dimension order:

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

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from node_agent.vocab.layout import KVLayout, LayoutName


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

    @functools.cached_property
    def wide_planes(self) -> tuple[torch.Tensor, ...]:
        """``planes`` viewed with the widest element that tiles their rows
        (:func:`widest_view`), built on first use and kept with the registration."""
        return tuple(widest_view(p) for p in self.planes)

    @functools.cached_property
    def _page_views(self) -> dict[int, tuple[torch.Tensor | None, ...]]:
        return {}

    def page_planes(self, tpb: int) -> tuple[torch.Tensor | None, ...]:
        """``wide_planes`` as rows of ``tpb`` consecutive slots (row ``i``: slots
        ``i * tpb ..``), or None for a plane whose rows are not dense (its row
        stride is not its width); built once per ``tpb`` and kept with the
        registration, so a copy by page builds no views."""
        got = self._page_views.get(tpb)
        if got is None:
            got = self._page_views[tpb] = tuple(_page_view(p, tpb) for p in self.wide_planes)
        return got


def _page_view(plane: torch.Tensor, tpb: int) -> torch.Tensor | None:
    """``plane`` (2-D) as rows of ``tpb`` of its rows, or None where its rows are not dense."""
    if plane.stride(0) != plane.shape[1]:
        return None
    n = plane.shape[0] // tpb
    return plane[: n * tpb].view(n, -1)


def widest_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D, unit stride in dim 1) viewed with the widest element that tiles its rows.

    Index kernels copy element by element; 16-byte elements make a row copy
    close to ``memcpy`` speed. Only the bytes are reinterpreted, never the values,
    so copies stay bit-exact.
    """
    row_bytes = t.shape[1] * t.element_size()
    for wide in (torch.complex128, torch.int64, torch.int32):
        size = wide.itemsize
        if (row_bytes % size == 0 and (t.stride(0) * t.element_size()) % size == 0
                and (t.storage_offset() * t.element_size()) % size == 0
                and t.data_ptr() % size == 0):
            return t.view(wide)
    return t


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
        tensors = _layer_tensors(layout, rank, groups)
        raw = [(f"buffers[0][{i}]", t) for i, t in enumerate(tensors)]
        expected_tail = (layout.heads_per_rank, layout.head_size)
        num_slots = _check_tensors(layout, rank, raw, expected_tail, slot_dim=1)
        planes = tuple(
            t[kv].view(num_slots, layout.row_elems) for _, t in raw for kv in range(layout.kv_dim)
        )
    return RegisteredBuffers(rank=rank, planes=planes, num_slots=num_slots,
                             device=planes[0].device)


def _layer_tensors(layout: KVLayout, rank: int,
                   groups: list[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The one list of per-layer tensors of a layout with one tensor per layer
    (``ValueError`` naming the rank, the count found and the count expected)."""
    if len(groups) != 1:
        raise ValueError(
            f"rank {rank}: got {len(groups)} buffer lists, expected 1 (one tensor per layer) "
            f"for layout {layout.name.value}"
        )
    tensors = list(groups[0])
    if len(tensors) != layout.num_layers:
        raise ValueError(f"rank {rank}: got {len(tensors)} layer tensors, expected "
                         f"num_layers={layout.num_layers}")
    return tensors


def _register_paged(layout: KVLayout, rank: int,
                    groups: list[Sequence[torch.Tensor]]) -> RegisteredBuffers:
    """``layer_block_head_token_kv``: one ``(num_blocks, heads, tpb, kv_dim * head_size)``
    tensor per layer, each page dense; planes are ``(num_blocks, page_elems)`` views."""
    tensors = _layer_tensors(layout, rank, groups)
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

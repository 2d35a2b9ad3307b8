"""vLLM's paged KV layout (``layer_block_head_token_kv``): registration of strided,
layer-interleaved views of one buffer, whole-page round trips into other blocks
(CPU and SSD tiers), and the refusals (slots that are not whole pages, padded pages,
wrong shapes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.planes import register_buffers
from node_agent.engine_api.buffers import open_buffer
from node_agent.integrations.vllm.shm_pool import SharedKVAllocation
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName
from tests.backend.backend_helpers import config, tokens

TPB = 4
LAYERS, HEADS, HEAD = 3, 2, 8
NUM_BLOCKS = 16


def paged_layout() -> KVLayout:
    return KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD, kv_dim=2,
                    dtype=KVDtype.BFLOAT16, tokens_per_block=TPB,
                    name=LayoutName.LAYER_BLOCK_HEAD_TOKEN_KV)


def interleaved_views(buf: torch.Tensor) -> list[torch.Tensor]:
    """vLLM-style views: block b of layer l at ``(b * LAYERS + l) * page`` (layers
    interleaved within each block), each ``(blocks, heads, tpb, 2 * head)``."""
    page = HEADS * TPB * 2 * HEAD
    return [torch.as_strided(buf, (NUM_BLOCKS, HEADS, TPB, 2 * HEAD),
                             (LAYERS * page, TPB * 2 * HEAD, 2 * HEAD, 1), layer * page)
            for layer in range(LAYERS)]


def page_bytes(views: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    return [v[block].contiguous().view(torch.uint8) for v in views]


def block_slots(blocks: list[int]) -> np.ndarray:
    b = np.asarray(blocks, dtype=np.int64)
    return (b[:, None] * TPB + np.arange(TPB)).reshape(-1)


def put(b: EmbeddedBackend, toks: np.ndarray, src: list[int]) -> None:
    tid, mask = b.put_match(toks)
    assert mask.all()
    [wid] = b.launch([tid], [block_slots(src)])
    assert b.wait([wid], timeout=10)[wid].status.value == "success"


def get(b: EmbeddedBackend, toks: np.ndarray, dst: list[int]) -> None:
    tid, mask = b.get_match(toks)
    assert mask.all()
    [wid] = b.launch([tid], [block_slots(dst)])
    assert b.wait([wid], timeout=10)[wid].status.value == "success"


def roundtrip(b: EmbeddedBackend, views: list[torch.Tensor], src: list[int],
              dst: list[int]) -> None:
    toks = tokens(len(src) * TPB)
    put(b, toks, src)
    get(b, toks, dst)


def test_interleaved_views_round_trip_whole_pages_into_other_blocks() -> None:
    layout = paged_layout()
    buf = torch.randn(NUM_BLOCKS * LAYERS * HEADS * TPB * 2 * HEAD).to(torch.bfloat16)
    views = interleaved_views(buf)
    b = EmbeddedBackend(config(layout, cpu_blocks=8))
    b.start()
    try:
        b.register_kv_buffers(0, [views])
        src, dst = [1, 2, 5, 9], [15, 3, 4, 11]
        before = [page_bytes(views, s) for s in src]
        other = page_bytes(views, 0)
        roundtrip(b, views, src, dst)
        for want, d in zip(before, dst, strict=True):
            for a, c in zip(want, page_bytes(views, d), strict=True):
                assert a.equal(c)
        assert all(a.equal(c) for a, c in zip(other, page_bytes(views, 0), strict=True))
    finally:
        b.shutdown()


def test_pages_spilled_to_ssd_load_back_bit_exact(tmp_path: Path) -> None:
    layout = paged_layout()
    buf = torch.randn(NUM_BLOCKS * LAYERS * HEADS * TPB * 2 * HEAD).to(torch.bfloat16)
    views = interleaved_views(buf)
    b = EmbeddedBackend(config(layout, cpu_blocks=2, ssd_blocks=16, ssd_dir=tmp_path))
    b.start()
    try:
        b.register_kv_buffers(0, [views])
        src, dst = [1, 2], [14, 15]
        before = [page_bytes(views, s) for s in src]
        first = tokens(2 * TPB, seed=1)
        put(b, first, src)
        put(b, tokens(2 * TPB, seed=2), [3, 4])  # pushes the first prompt to the SSD tier
        assert b.stats().tiers["ssd"].hit_blocks == 0
        get(b, first, dst)
        assert b.stats().tiers["ssd"].hit_blocks > 0  # the load read the SSD tier
        for want, d in zip(before, dst, strict=True):
            for a, c in zip(want, page_bytes(views, d), strict=True):
                assert a.equal(c)
    finally:
        b.shutdown()


def test_slots_that_are_not_whole_pages_are_refused() -> None:
    layout = paged_layout()
    buf = torch.zeros(NUM_BLOCKS * LAYERS * HEADS * TPB * 2 * HEAD, dtype=torch.bfloat16)
    b = EmbeddedBackend(config(layout, cpu_blocks=8))
    b.start()
    try:
        b.register_kv_buffers(0, [interleaved_views(buf)])
        toks = tokens(2 * TPB)
        tid, _ = b.put_match(toks)
        slots = block_slots([1, 2])[::-1].copy()  # every slot, but not in page order
        [wid] = b.launch([tid], [slots])
        assert b.wait([wid], timeout=10)[wid].status.value == "failed"
        assert b.get_match(toks)[0] == -1  # nothing became visible
    finally:
        b.shutdown()


def test_registration_refuses_wrong_shapes_and_padded_pages() -> None:
    layout = paged_layout()
    ok = torch.zeros(NUM_BLOCKS, HEADS, TPB, 2 * HEAD, dtype=torch.bfloat16)
    reg = register_buffers(layout, 0, [[ok] * LAYERS])
    assert reg.paged and reg.num_slots == NUM_BLOCKS * TPB
    assert reg.planes[0].shape == (NUM_BLOCKS, HEADS * TPB * 2 * HEAD)
    wrong_tpb = torch.zeros(NUM_BLOCKS, HEADS, TPB * 2, 2 * HEAD, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"expected \(num_blocks, 2, 4, 16\)"):
        register_buffers(layout, 0, [[wrong_tpb] * LAYERS])
    padded = torch.zeros(NUM_BLOCKS, HEADS, TPB, 4 * HEAD, dtype=torch.bfloat16)[..., : 2 * HEAD]
    with pytest.raises(ValueError, match="one dense run"):
        register_buffers(layout, 0, [[padded] * LAYERS])
    with pytest.raises(ValueError, match=r"expected 1 \(one tensor per layer"):
        register_buffers(layout, 0, [[ok] * LAYERS, [ok] * LAYERS])


def test_shared_allocation_and_strided_shm_handles_alias_the_engine_buffer() -> None:
    """The engine's buffer allocated under SharedKVAllocation lands in /dev/shm; a
    strided shm handle of a layer view opens onto the same bytes (no copy)."""
    alloc = SharedKVAllocation(prefix="flexkv-test")
    n = NUM_BLOCKS * LAYERS * HEADS * TPB * 2 * HEAD * 2
    try:
        with alloc:
            raw = torch.zeros(max(n, 1 << 20), dtype=torch.int8)
            small = torch.zeros(16, dtype=torch.int8)  # below the threshold: plain torch
        assert alloc.name is not None and Path(f"/dev/shm/{alloc.name}").exists()
        assert raw.untyped_storage().data_ptr() == alloc.tensor.untyped_storage().data_ptr()
        assert small.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr()
        views = interleaved_views(raw[:n].view(torch.bfloat16))
        v = views[1]
        handle = {"kind": "shm", "name": alloc.name, "dtype": "bfloat16",
                  "shape": list(v.shape), "stride": list(v.stride()),
                  "offset": v.storage_offset() * v.element_size()}
        opened = open_buffer(handle)
        try:
            opened.tensor[3, 1, 2, 5] = 7.0
            assert float(v[3, 1, 2, 5]) == 7.0
            assert float(views[0][3, 1, 2, 5]) == 0.0 and float(views[2][3, 1, 2, 5]) == 0.0
        finally:
            opened.close()
        too_far = dict(handle, offset=handle["offset"] + (1 << 30))
        with pytest.raises(ValueError, match="needs"):
            open_buffer(too_far)
    finally:
        alloc.close()

"""The copy engine's paths: block runs, scattered blocks, mixed tiers, odd row widths,
arbitrary bit patterns (NaN payloads included) - all bit-exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.backend.stage_store import TierStore
from node_agent.backend.transfer import MAX_SEGMENTS, page_index
from node_agent.vocab.layout import KVDtype, KVLayout
from node_agent.vocab.placement import BlockLocation, Direction, Tier, TierMove, TransferPlan
from tests.backend.backend_helpers import config, small_layout


def _random_bytes_buffers(layout: KVLayout, slots: int, seed: int) -> list[list[torch.Tensor]]:
    """Buffers filled with random raw bytes: every bit pattern, NaN payloads included."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layout.kv_dim):
        group = []
        for _ in range(layout.num_layers):
            nbytes = slots * layout.row_bytes
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
            group.append(raw.view(layout.dtype.torch_dtype)
                         .view(slots, layout.heads_per_rank, layout.head_size))
        out.append(group)
    return out


def _rows(bufs: list[list[torch.Tensor]], slots: np.ndarray) -> list[torch.Tensor]:
    idx = torch.as_tensor(slots)
    return [t.index_select(0, idx).contiguous().view(torch.uint8) for g in bufs for t in g]


def test_page_index_only_for_aligned_consecutive_blocks() -> None:
    aligned = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    assert page_index(aligned, 4).tolist() == [2, 0]
    assert page_index(aligned + 1, 4) is None  # not page-aligned
    assert page_index(torch.tensor([8, 9, 11, 10]), 4) is None  # not consecutive
    assert page_index(aligned, 1) is None


def _slots(style: str, rng: np.random.Generator, n_blocks: int, tpb: int, lo: int,
           hi: int) -> np.ndarray:
    if style == "pages":  # SGLang with page_size == tokens_per_block: aligned, shuffled pages
        pages = rng.permutation(np.arange(lo // tpb, hi // tpb))[:n_blocks]
        return (pages[:, None] * tpb + np.arange(tpb)).reshape(-1).astype(np.int64)
    return rng.permutation(np.arange(lo, hi))[: n_blocks * tpb].astype(np.int64)


@pytest.mark.parametrize("style", ["pages", "tokens"])
@pytest.mark.parametrize("head_size", [8, 3], ids=["wide-rows", "odd-rows"])
@pytest.mark.parametrize("dtype", [KVDtype.BFLOAT16, KVDtype.FLOAT32])
def test_scattered_and_mixed_tier_plans_round_trip(tmp_path: Path, head_size: int,
                                                   dtype: KVDtype, style: str) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=head_size, dtype=dtype,
                      tokens_per_block=4)
    st = TierStore(config(layout, cpu_blocks=2 * (MAX_SEGMENTS + 4), ssd_blocks=8,
                          ssd_dir=tmp_path))
    bufs = _random_bytes_buffers(layout, 256, 0)
    st.register_kv_buffers(0, bufs)
    tpb = layout.tokens_per_block
    scattered = [BlockLocation(Tier.CPU, b) for b in range(0, 2 * (MAX_SEGMENTS + 4), 2)]
    rng = np.random.default_rng(1)
    src = _slots(style, rng, len(scattered), tpb, 0, 128)
    st.execute(TransferPlan(Direction.STORE, tuple(scattered)), src, timeout=10)
    # move three of them to SSD, so the load plan mixes tiers
    moves = [TierMove(scattered[i], BlockLocation(Tier.SSD, 7 - i)) for i in (1, 4, 5)]
    st.apply_moves(moves)
    mixed = list(scattered)
    for i, m in zip((1, 4, 5), moves, strict=True):
        assert m.dst is not None
        mixed[i] = m.dst
    dst = _slots(style, rng, len(scattered), tpb, 128, 256)
    st.execute(TransferPlan(Direction.LOAD, tuple(mixed)), dst, timeout=10)
    for a, b in zip(_rows(bufs, src), _rows(bufs, dst), strict=True):
        assert a.equal(b)
    st.close()


@pytest.mark.parametrize("style", ["pages", "tokens"])
def test_contiguous_runs_round_trip_with_random_bytes(style: str) -> None:
    layout = small_layout()
    st = TierStore(config(layout, cpu_blocks=16))
    bufs = _random_bytes_buffers(layout, 128, 3)
    st.register_kv_buffers(0, bufs)
    plan = tuple(BlockLocation(Tier.CPU, b) for b in (3, 4, 5, 9, 10))
    src = _slots(style, np.random.default_rng(2), 5, layout.tokens_per_block, 0, 64)
    st.execute(TransferPlan(Direction.STORE, plan), src, timeout=10)
    dst = np.arange(64, 84, dtype=np.int64)
    st.execute(TransferPlan(Direction.LOAD, plan), dst, timeout=10)
    for a, b in zip(_rows(bufs, src), _rows(bufs, dst), strict=True):
        assert a.equal(b)


@pytest.mark.parametrize("style", ["pages", "tokens"])
@pytest.mark.parametrize("kv_dim", [2, 1], ids=["mha", "mla"])
def test_ssd_loads_reach_every_tp_rank(tmp_path: Path, kv_dim: int, style: str) -> None:
    layout = small_layout(kv_dim=kv_dim, tp_size=2)
    st = TierStore(config(layout, cpu_blocks=4, ssd_blocks=4, ssd_dir=tmp_path))
    bufs = [_random_bytes_buffers(layout, 64, seed) for seed in (5, 6)]
    for rank, b in enumerate(bufs):
        st.register_kv_buffers(rank, b)
    tpb = layout.tokens_per_block
    rng = np.random.default_rng(4)
    cpu = tuple(BlockLocation(Tier.CPU, i) for i in range(3))
    src = _slots(style, rng, 3, tpb, 0, 32)
    st.execute(TransferPlan(Direction.STORE, cpu), src, timeout=10)
    ssd = tuple(BlockLocation(Tier.SSD, 3 - i) for i in range(3))
    st.apply_moves([TierMove(c, s) for c, s in zip(cpu, ssd, strict=True)])
    dst = _slots(style, rng, 3, tpb, 32, 64)
    st.execute(TransferPlan(Direction.LOAD, ssd), dst, timeout=10)
    for rank in (0, 1):
        source = bufs[0] if layout.is_mla else bufs[rank]  # MLA stores rank 0's latent once
        for a, b in zip(_rows(source, src), _rows(bufs[rank], dst), strict=True):
            assert a.equal(b)
    st.close()

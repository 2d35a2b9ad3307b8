"""Bit-exact round trips through the embedded backend for every layout and dtype."""

from __future__ import annotations

import numpy as np
import pytest

from node_agent.vocab.layout import KVDtype, LayoutName
from tests.backend.backend_helpers import (
    TPB,
    config,
    load,
    make_buffers,
    small_layout,
    started,
    store,
    token_rows,
    tokens,
)


@pytest.mark.parametrize("dtype", list(KVDtype))
@pytest.mark.parametrize("kv_dim", [2, 1], ids=["mha", "mla"])
@pytest.mark.parametrize("name", [n for n in LayoutName if not n.paged])
def test_store_then_load_into_other_slots_is_bit_exact(
    dtype: KVDtype, kv_dim: int, name: LayoutName
) -> None:
    layout = small_layout(kv_dim=kv_dim, dtype=dtype, name=name)
    b, [bufs] = started(config(layout, cpu_blocks=32))
    try:
        toks = tokens(10 * TPB + 3)
        src = np.arange(0, len(toks), dtype=np.int64) * 2 + 1  # odd slots
        mask = store(b, toks, src)
        assert mask.sum() == 10 * TPB and not mask[-3:].any()  # trailing partial block ignored
        dst = np.arange(len(toks), dtype=np.int64)[::-1].copy() * 2  # even slots, reversed
        got = load(b, toks, dst)
        assert got.sum() == 10 * TPB
        n = 10 * TPB
        for a, c in zip(token_rows(layout, bufs, src[:n]), token_rows(layout, bufs, dst[:n]),
                        strict=True):
            assert a.equal(c)
    finally:
        b.shutdown()


def test_tensor_parallel_ranks_each_round_trip_their_own_heads() -> None:
    layout = small_layout(tp_size=2)
    b, bufs = started(config(layout, cpu_blocks=16))
    try:
        assert b.is_ready()
        toks = tokens(8 * TPB)
        src = np.arange(len(toks), dtype=np.int64)
        dst = src + 100
        store(b, toks, src)
        load(b, toks, dst)
        for rank_bufs in bufs:
            for a, c in zip(token_rows(layout, rank_bufs, src), token_rows(layout, rank_bufs, dst),
                            strict=True):
                assert a.equal(c)
        # The ranks hold different heads, so the copies must not have mixed them.
        assert not token_rows(layout, bufs[0], dst)[0].equal(token_rows(layout, bufs[1], dst)[0])
    finally:
        b.shutdown()


def test_mla_loads_rank0_latent_into_every_rank() -> None:
    layout = small_layout(kv_dim=1, tp_size=2)
    cfg = config(layout, cpu_blocks=16)
    b, bufs = started(cfg)
    try:
        assert layout.bytes_per_block == layout.segment_bytes * layout.num_planes  # one copy
        toks = tokens(4 * TPB)
        src = np.arange(len(toks), dtype=np.int64)
        store(b, toks, src)
        dst = src + 50
        load(b, toks, dst)
        for rank_bufs in bufs:
            for a, c in zip(token_rows(layout, bufs[0], src), token_rows(layout, rank_bufs, dst),
                            strict=True):
                assert a.equal(c)
    finally:
        b.shutdown()


def test_not_ready_until_every_rank_registered() -> None:
    from node_agent.backend.embedded import EmbeddedBackend

    layout = small_layout(tp_size=2)
    b = EmbeddedBackend(config(layout, cpu_blocks=4))
    b.register_kv_buffers(1, make_buffers(layout, 16, 0))  # before start is fine
    assert not b.is_ready()
    b.start()
    assert not b.is_ready()
    b.register_kv_buffers(0, make_buffers(layout, 16, 1))
    assert b.is_ready()
    b.shutdown()
    assert not b.is_ready()

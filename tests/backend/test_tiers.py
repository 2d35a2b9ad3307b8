"""CPU and SSD tiers: spill and load back bit-exact, restart behaviour, watermarks, leaf-first."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.ssd_tier import FILE_NAME
from node_agent.metrics import AgentMetrics
from node_agent.vocab.placement import BlockLocation, Tier
from tests.backend.backend_helpers import (
    TPB,
    config,
    load,
    make_buffers,
    same_rows,
    small_layout,
    started,
    store,
    tokens,
)


def _no_orphans(b: EmbeddedBackend) -> None:
    index = b._index
    assert index is not None
    index.check_consistency()  # parents cached, counts exact, no block held twice or lost


def test_evicted_blocks_spill_to_ssd_and_load_back_bit_exact(tmp_path: Path) -> None:
    layout = small_layout()
    b, [bufs] = started(config(layout, cpu_blocks=4, ssd_blocks=8, ssd_dir=tmp_path,
                               high_watermark=1.0, low_watermark=1.0), num_slots=128)
    try:
        a, c = tokens(4 * TPB, seed=1), tokens(4 * TPB, seed=2)
        src_a = np.arange(4 * TPB, dtype=np.int64)
        store(b, a, src_a)
        store(b, c, src_a + 4 * TPB)  # CPU full: every block of `a` spills to SSD
        st = b.stats().tiers
        assert st["cpu"].used_blocks == 4 and st["ssd"].used_blocks == 4
        assert st["cpu"].evictions == 4
        dst = np.arange(64, 64 + 4 * TPB, dtype=np.int64)[::-1].copy()
        assert load(b, a, dst).all()
        assert b.stats().tiers["ssd"].hit_blocks == 4
        assert same_rows(layout, bufs, src_a, dst)
        _no_orphans(b)
    finally:
        b.shutdown()


def test_full_ssd_drops_leaf_first_and_keeps_chains_reachable(tmp_path: Path) -> None:
    layout = small_layout()
    b, [bufs] = started(config(layout, cpu_blocks=2, ssd_blocks=2, ssd_dir=tmp_path,
                               high_watermark=1.0, low_watermark=1.0), num_slots=64)
    try:
        a, c, d = (tokens(2 * TPB, seed=s) for s in (1, 2, 3))
        for i, t in enumerate((a, c, d)):
            store(b, t, np.arange(i * 2 * TPB, (i + 1) * 2 * TPB, dtype=np.int64))
        assert b.get_match(a)[0] == -1  # dropped whole, deepest block first
        assert b.stats().tiers["ssd"].evictions == 2
        dst = np.arange(48, 48 + 2 * TPB, dtype=np.int64)
        assert load(b, c, dst).all()  # from SSD
        src = np.arange(2 * TPB, 4 * TPB, dtype=np.int64)
        assert same_rows(layout, bufs, src, dst)
        _no_orphans(b)
    finally:
        b.shutdown()


def test_ssd_index_does_not_survive_a_restart(tmp_path: Path) -> None:
    """The documented claim: SSD files are recreated on start, nothing cached survives."""
    layout = small_layout()
    cfg = config(layout, cpu_blocks=2, ssd_blocks=4, ssd_dir=tmp_path,
                 high_watermark=1.0, low_watermark=1.0)
    b, _ = started(cfg)
    a = tokens(2 * TPB, seed=1)
    store(b, a, np.arange(2 * TPB, dtype=np.int64))
    store(b, tokens(2 * TPB, seed=2), np.arange(2 * TPB, 4 * TPB, dtype=np.int64))
    spilled = b.store.read_block(BlockLocation(Tier.SSD, 0))
    assert any(spilled)
    b.shutdown()
    f = tmp_path / FILE_NAME.format(slot=0, index=0)
    assert f.stat().st_size == 4 * layout.bytes_per_block
    again, _ = started(cfg)
    try:
        assert again.get_match(a)[0] == -1
        assert not any(again.store.read_block(BlockLocation(Tier.SSD, 0)))  # truncated
        assert f.stat().st_size == 4 * layout.bytes_per_block  # preallocated again
    finally:
        again.shutdown()


def test_watermarks_evict_from_high_down_to_low() -> None:
    b, _ = started(config(small_layout(), cpu_blocks=10, high_watermark=0.8, low_watermark=0.5))
    try:
        prompts = [tokens(TPB, seed=s) for s in range(9)]
        for i, p in enumerate(prompts[:8]):
            store(b, p, np.arange(i * TPB, (i + 1) * TPB, dtype=np.int64))
        assert b.stats().tiers["cpu"].used_blocks == 8  # at, not above, 80 %
        store(b, prompts[8], np.arange(8 * TPB, 9 * TPB, dtype=np.int64))
        st = b.stats().tiers["cpu"]
        assert st.used_blocks == 5 and st.evictions == 4
        hits = [b.get_match(p)[0] > 0 for p in prompts]
        assert hits == [False] * 4 + [True] * 5  # least recently used went first
    finally:
        b.shutdown()


def test_eviction_is_leaf_first_not_plain_lru() -> None:
    b, _ = started(config(small_layout(), cpu_blocks=5, high_watermark=1.0, low_watermark=1.0))
    try:
        chain, other = tokens(4 * TPB, seed=1), tokens(TPB, seed=2)
        store(b, chain, np.arange(4 * TPB, dtype=np.int64))
        store(b, other, np.arange(4 * TPB, 5 * TPB, dtype=np.int64))
        gid, _ = b.get_match(other)  # `other` is now the most recent
        b.cancel([gid])
        tid, mask = b.put_match(tokens(TPB, seed=3))  # needs one block
        assert mask.all()
        b.cancel([tid])
        gid, mask = b.get_match(chain)
        assert mask.sum() == 3 * TPB  # the chain lost its last block, not its head
        b.cancel([gid])
        _no_orphans(b)
    finally:
        b.shutdown()


def test_locked_blocks_are_never_evicted() -> None:
    layout = small_layout()
    b, [bufs] = started(config(layout, cpu_blocks=4, high_watermark=1.0, low_watermark=1.0))
    try:
        a = tokens(4 * TPB, seed=1)
        src = np.arange(4 * TPB, dtype=np.int64)
        store(b, a, src)
        gid, _ = b.get_match(a)
        assert b.put_match(tokens(2 * TPB, seed=2))[0] == -1  # tier full of locked blocks
        dst = src + 100
        [w] = b.launch([gid], [dst])
        assert b.wait([w])[w].status.value == "success"
        assert same_rows(layout, bufs, src, dst)
    finally:
        b.shutdown()


def test_tiers_sharing_a_directory_get_their_own_files(tmp_path: Path) -> None:
    layout = small_layout()
    cfg = config(layout, cpu_blocks=1, ssd_blocks=2, ssd_dir=tmp_path,
                 high_watermark=1.0, low_watermark=1.0)
    first, _ = started(cfg, seed=1)
    second, _ = started(cfg, seed=2)
    try:
        for b, slots in ((first, np.arange(TPB)), (second, np.arange(TPB, 2 * TPB))):
            store(b, tokens(TPB, seed=1), slots.astype(np.int64))
            store(b, tokens(TPB, seed=2), slots.astype(np.int64))  # spills the first block
        a = first.store.read_block(BlockLocation(Tier.SSD, 0))
        b2 = second.store.read_block(BlockLocation(Tier.SSD, 0))
        assert a != b2  # different engine data, different files: nothing clobbered
        assert first.store.ssd is not None and second.store.ssd is not None
        assert {first.store.ssd.slot, second.store.ssd.slot} == {0, 1}
    finally:
        first.shutdown()
        second.shutdown()
    third, _ = started(cfg)  # slots freed on shutdown: slot 0 is reused, not leaked
    try:
        assert third.store.ssd is not None and third.store.ssd.slot == 0
    finally:
        third.shutdown()


def test_failed_spill_drops_instead_and_never_serves_unwritten_bytes(tmp_path: Path) -> None:
    layout = small_layout()
    b, [bufs] = started(config(layout, cpu_blocks=2, ssd_blocks=4, ssd_dir=tmp_path,
                               high_watermark=1.0, low_watermark=1.0,
                               deferred_visibility=True), num_slots=64)
    try:
        ssd = b.store.ssd
        assert ssd is not None

        def full_disk(index: int, buffers: object) -> None:
            raise OSError(28, "No space left on device")

        ssd.write = full_disk  # type: ignore[method-assign]
        a, c = tokens(2 * TPB, seed=1), tokens(2 * TPB, seed=2)
        for t, lo in ((a, 0), (c, 2 * TPB)):
            tid, _ = b.put_match(t)
            [w] = b.launch([tid], [np.arange(lo, lo + 2 * TPB, dtype=np.int64)])
            assert b.wait([w])[w].status.value == "success"
            b.publish(w)
        moves = b.drain_moves()
        assert moves and all(m.dst is None for m in moves)  # dropped, not spilled
        assert b.get_match(a)[0] == -1  # a miss, never a load of unwritten SSD bytes
        st = b.stats().tiers
        assert st["ssd"].used_blocks == 0 and st["cpu"].used_blocks == 2
        dst = np.arange(32, 32 + 2 * TPB, dtype=np.int64)
        assert load(b, c, dst).all()
        src = np.arange(2 * TPB, 4 * TPB, dtype=np.int64)
        assert same_rows(layout, bufs, src, dst)
        _no_orphans(b)
    finally:
        b.shutdown()


def test_failed_spills_are_counted_as_ssd_errors(tmp_path: Path) -> None:
    """Each CPU block whose copy to SSD failed counts in
    flexkv_agent_ssd_errors_total{op="spill"}, exported at 0 until then."""
    layout = small_layout()
    metrics = AgentMetrics()
    b = EmbeddedBackend(config(layout, cpu_blocks=2, ssd_blocks=4, ssd_dir=tmp_path,
                               high_watermark=1.0, low_watermark=1.0,
                               deferred_visibility=True), metrics=metrics)
    b.start()
    try:
        b.register_kv_buffers(0, make_buffers(layout, 64, 1))
        value = metrics.registry.get_sample_value
        assert value("flexkv_agent_ssd_errors_total", {"op": "spill"}) == 0
        ssd = b.store.ssd
        assert ssd is not None

        def full_disk(index: int, buffers: object) -> None:
            raise OSError(28, "No space left on device")

        ssd.write = full_disk  # type: ignore[method-assign]
        for seed, lo in ((1, 0), (2, 2 * TPB)):
            t = tokens(2 * TPB, seed=seed)
            tid, _ = b.put_match(t)
            [w] = b.launch([tid], [np.arange(lo, lo + 2 * TPB, dtype=np.int64)])
            assert b.wait([w])[w].status.value == "success"
            b.publish(w)
        dropped = [m for m in b.drain_moves() if m.dst is None]
        assert dropped
        assert value("flexkv_agent_ssd_errors_total", {"op": "spill"}) == len(dropped)
    finally:
        b.shutdown()

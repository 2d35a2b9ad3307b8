"""A persistent SSD tier: its verified blocks are indexed again after a restart, torn or
foreign ones never are; a clean stop spills the CPU tier; the on-disk format's checks."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.index import BlockIndex
from node_agent.backend.ssd_format import (
    HEADER_BYTES,
    RECORD_BYTES,
    RECORDS_NAME,
    HeaderError,
    block_checksum,
    decode_header,
    decode_records,
    encode_header,
    encode_record,
    tier_identity,
)
from node_agent.backend.ssd_owner import DirectoryOwner, SsdPathInUse
from node_agent.backend.ssd_recovery import recover
from node_agent.backend.ssd_tier import FILE_NAME, SsdTier
from node_agent.metrics import AgentMetrics
from node_agent.vocab.placement import BlockLocation, Tier
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
from tests.support.waiting import wait_for

BLOCKS = 4  # blocks per prompt


def _cfg(tmp_path: Path, **kw: object) -> EmbeddedBackendConfig:
    base = config(small_layout(), cpu_blocks=4, ssd_blocks=16, ssd_dir=tmp_path,
                  high_watermark=1.0, low_watermark=1.0, ssd_persist=True, pool="p",
                  namespace="model:a")
    return dataclasses.replace(base, **kw)


def _recovered(cfg: EmbeddedBackendConfig, metrics: AgentMetrics | None = None,
               ) -> tuple[EmbeddedBackend, list[list[torch.Tensor]]]:
    """A started backend whose recovery finished, with fresh engine buffers."""
    b = EmbeddedBackend(cfg, metrics=metrics)
    b.start()
    assert b.recovery_done.wait(30), "recovery did not finish"
    bufs = make_buffers(cfg.layout, 256, seed=99)
    b.register_kv_buffers(0, bufs)
    return b, bufs


def _fill(tmp_path: Path, cfg: EmbeddedBackendConfig,
          ) -> tuple[list[np.ndarray], list[list[torch.Tensor]]]:
    """Store three prompts (the CPU tier holds one): two spill to SSD before the stop,
    the stop spills the third. Returns the prompts and each one's stored KV."""
    b, [bufs] = started(cfg)
    prompts = [tokens(BLOCKS * TPB, seed=s) for s in (1, 2, 3)]
    kv = []
    for i, p in enumerate(prompts):
        slots = np.arange(i * BLOCKS * TPB, (i + 1) * BLOCKS * TPB, dtype=np.int64)
        store(b, p, slots)
        kv.append(token_rows(cfg.layout, bufs, slots))
    b.shutdown()
    assert b.spilled_on_stop == BLOCKS
    return prompts, kv


def _loads_bit_exact(b: EmbeddedBackend, bufs: list[list[torch.Tensor]], p: np.ndarray,
                     want: list[torch.Tensor]) -> None:
    slots = np.arange(200, 200 + len(p), dtype=np.int64)
    mask = load(b, p, slots)
    assert mask.all(), "a prompt stored before the restart is not a full hit"
    got = token_rows(b.config.layout, bufs, slots)
    assert all(bool((g == w).all()) for g, w in zip(got, want, strict=True))


def test_blocks_spilled_before_a_clean_stop_are_hits_after_it_bit_exact(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prompts, kv = _fill(tmp_path, cfg)
    metrics = AgentMetrics()
    b, bufs = _recovered(cfg, metrics)
    try:
        assert b.recovered_blocks == 3 * BLOCKS
        assert metrics.registry.get_sample_value("flexkv_agent_recovered_blocks_total") == 12
        assert not any(b.recovered_dropped.values())
        assert b.stats().tiers["ssd"].used_blocks == 3 * BLOCKS
        for p, want in zip(prompts, kv, strict=True):
            _loads_bit_exact(b, bufs, p, want)
        assert b._index is not None
        b._index.check_consistency()
        # The recovered tier keeps working: new prompts spill over recovered blocks.
        for s in range(10, 16):
            store(b, tokens(BLOCKS * TPB, seed=s),
                  np.arange(BLOCKS * TPB, dtype=np.int64))
        b._index.check_consistency()
    finally:
        b.shutdown()


def test_a_torn_block_is_dropped_and_counted_and_its_descendants_with_it(
        tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prompts, _ = _fill(tmp_path, cfg)
    records = (tmp_path / RECORDS_NAME.format(slot=0)).read_bytes()[HEADER_BYTES:]
    # Find the SSD block holding the second block of the first prompt and tear it.
    recs, bad = decode_records(records, tier_identity(cfg).digest(), 8)
    assert bad == 0 and len(recs) == 3 * BLOCKS
    heads = {r.hash for r in recs if r.parent is None}
    by_parent = {r.parent: r for r in recs if r.parent is not None}
    first_heads = [r for r in recs if r.parent is None]
    victim = by_parent[first_heads[0].hash]  # a second block: its two children go too
    bpb = cfg.layout.bytes_per_block
    with open(tmp_path / FILE_NAME.format(slot=0, index=0), "r+b") as f:
        f.seek(victim.block * bpb + bpb // 2)
        f.write(b"\xff" * 16)
    metrics = AgentMetrics()
    b, _ = _recovered(cfg, metrics)
    try:
        assert len(heads) == 3
        assert b.recovered_dropped["checksum"] == 1
        assert b.recovered_dropped["orphan"] == 2
        assert b.recovered_blocks == 3 * BLOCKS - 3
        get = metrics.registry.get_sample_value
        assert get("flexkv_agent_recovered_dropped_blocks_total", {"reason": "checksum"}) == 1
        assert get("flexkv_agent_recovered_dropped_blocks_total", {"reason": "orphan"}) == 2
        hit = [int(load(b, p, np.arange(200, 200 + len(p))).sum()) // TPB for p in prompts]
        assert sorted(hit) == [1, BLOCKS, BLOCKS]  # only the torn prompt's head survives
        b._index.check_consistency()  # type: ignore[union-attr]
    finally:
        b.shutdown()


@pytest.mark.parametrize("change", [
    {"cache_epoch": 1},
    {"namespace": "model:b"},
    {"pool": "other"},
    {"hash_algorithm": "xxh3_128"},
])
def test_another_epoch_model_pool_or_hash_never_recovers_and_the_files_are_cleaned(
        tmp_path: Path, change: dict[str, object]) -> None:
    cfg = _cfg(tmp_path)
    prompts, _ = _fill(tmp_path, cfg)
    other = dataclasses.replace(cfg, **change)  # type: ignore[arg-type]
    b, _ = _recovered(other)
    try:
        assert b.recovered_blocks == 0
        for p in prompts:
            assert b.get_match(p)[0] == -1
        assert not any(b.store.read_block(BlockLocation(Tier.SSD, 0)))  # truncated
    finally:
        b.shutdown()
    again, _ = _recovered(cfg)  # the old identity's files are gone for good
    try:
        assert again.recovered_blocks == 0
    finally:
        again.shutdown()


def test_another_layout_never_recovers(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    _fill(tmp_path, cfg)
    lay = dataclasses.replace(cfg.layout, tokens_per_block=2 * TPB, num_layers=3)
    other = dataclasses.replace(cfg, layout=lay, cpu_bytes=4 * lay.bytes_per_block,
                                ssd_bytes=8 * lay.bytes_per_block)
    b, _ = _recovered(other)
    try:
        assert b.recovered_blocks == 0 and not b.store.ssd.recorded  # type: ignore[union-attr]
    finally:
        b.shutdown()


def test_a_flush_forgets_every_block_written_before_it_across_a_restart(
        tmp_path: Path) -> None:
    epoch = [0]
    cfg = _cfg(tmp_path)
    b = EmbeddedBackend(cfg, cache_epoch=lambda: epoch[0])
    b.start()
    bufs = make_buffers(cfg.layout, 256, seed=1)
    b.register_kv_buffers(0, bufs)
    old = tokens(BLOCKS * TPB, seed=1)
    store(b, old, np.arange(BLOCKS * TPB, dtype=np.int64))
    epoch[0] = 1
    b.reset()
    new = tokens(BLOCKS * TPB, seed=2)
    store(b, new, np.arange(BLOCKS * TPB, dtype=np.int64))
    b.shutdown()
    again, _ = _recovered(dataclasses.replace(cfg, cache_epoch=1))
    try:
        assert again.get_match(old)[0] == -1
        assert again.get_match(new)[0] > 0
    finally:
        again.shutdown()


def test_a_tier_without_persistence_still_starts_empty(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prompts, _ = _fill(tmp_path, cfg)
    b, _ = _recovered(dataclasses.replace(cfg, ssd_persist=False))
    try:
        assert all(b.get_match(p)[0] == -1 for p in prompts)
    finally:
        b.shutdown()


def test_a_store_during_recovery_is_kept_and_recovered_children_attach_to_it(
        tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prompts, kv = _fill(tmp_path, cfg)
    b = EmbeddedBackend(cfg)
    b.start()
    # The recovery thread may or may not have finished: either way the index stays a
    # prefix tree, and every prompt is served bit-exact once it has.
    bufs = make_buffers(cfg.layout, 256, seed=5)
    b.register_kv_buffers(0, bufs)
    slots = np.arange(0, BLOCKS * TPB, dtype=np.int64)
    if store(b, prompts[0], slots).any():  # stored again before recovery indexed it
        kv[0] = token_rows(cfg.layout, bufs, slots)
    assert b.recovery_done.wait(30)
    try:
        for p, want in zip(prompts, kv, strict=True):
            _loads_bit_exact(b, bufs, p, want)
        b._index.check_consistency()  # type: ignore[union-attr]
    finally:
        b.shutdown()


# -- the on-disk format ---------------------------------------------------------------


def _identity(tmp_path: Path) -> bytes:
    return tier_identity(_cfg(tmp_path)).digest()


def test_a_torn_or_foreign_header_is_refused(tmp_path: Path) -> None:
    head = encode_header(tier_identity(_cfg(tmp_path)))
    assert decode_header(head)["pool"] == "p"
    with pytest.raises(HeaderError, match="checksum"):
        decode_header(head[:100] + b"x" + head[101:])
    with pytest.raises(HeaderError, match="expected"):
        decode_header(head[:HEADER_BYTES // 2])
    with pytest.raises(HeaderError, match="magic"):
        decode_header(b"\0" * HEADER_BYTES)


def test_records_decode_intact_and_refuse_torn_foreign_and_other_width(
        tmp_path: Path) -> None:
    ident = _identity(tmp_path)
    good = encode_record(7, 0xABC, 0x1234, 0x99, 8, ident)
    head = encode_record(8, 0xDEF, 0x99, None, 8, ident)
    torn = bytearray(encode_record(9, 1, 2, 3, 8, ident))
    torn[40] ^= 1
    foreign = encode_record(10, 1, 2, 3, 8, bytes(16))
    wide = encode_record(11, 1, 2, 3, 16, ident)
    raw = good + head + bytes(RECORD_BYTES) + bytes(torn) + foreign + wide
    recs, bad = decode_records(raw, ident, 8)
    assert [(r.block, r.seq, r.checksum, r.hash, r.parent) for r in recs] == [
        (0, 7, 0xABC, 0x1234, 0x99), (1, 8, 0xDEF, 0x99, None)]
    assert bad == 3  # torn, foreign identity, another hash width; the blank one is unused


def test_recovery_checks_every_block_against_its_recorded_checksum(tmp_path: Path) -> None:
    ident = _identity(tmp_path)
    blocks = {0: b"a" * 64, 1: b"b" * 64, 2: b"c" * 64, 3: b"d" * 64}

    def read_into(i: int, buf: memoryview) -> int:
        data = blocks[i]
        buf[:len(data)] = data
        return len(data)

    def rec(block: int, seq: int, h: int, parent: int | None, data: bytes) -> bytes:
        return encode_record(seq, block_checksum([memoryview(data)]), h, parent, 8, ident)

    raw = (rec(0, 1, 10, None, blocks[0])    # a chain head
           + rec(1, 2, 11, 10, b"old" * 20)  # its child, overwritten after its record
           + rec(2, 3, 12, 11, blocks[2])    # that one's child: an orphan
           + rec(3, 4, 13, None, blocks[0]))  # a record of other bytes than the block's
    recs, bad = decode_records(raw, ident, 8)
    found = recover(recs, bad, 64, read_into)
    assert [r.hash for r in found.blocks] == [10]
    assert found.dropped == {"record": 0, "checksum": 2, "duplicate": 0, "orphan": 1}
    # A second intact copy of one hash: the newest is kept, the other counted.
    blocks[3] = blocks[0]
    raw = rec(0, 1, 10, None, blocks[0]) + bytes(2 * RECORD_BYTES) \
        + rec(3, 4, 10, None, blocks[0])
    recs, bad = decode_records(raw, ident, 8)
    found = recover(recs, bad, 64, read_into)
    assert [(r.hash, r.block) for r in found.blocks] == [(10, 3)]
    assert found.dropped["duplicate"] == 1


def test_two_pools_never_share_an_ssd_directory_while_both_run(tmp_path: Path) -> None:
    a = DirectoryOwner([str(tmp_path)], "pool-a")
    a2 = DirectoryOwner([str(tmp_path)], "pool-a")  # another tier of the same pool
    with pytest.raises(SsdPathInUse, match=r"in use by pool 'pool-a'.*'pool-b'"):
        DirectoryOwner([str(tmp_path)], "pool-b")
    a.close()
    with pytest.raises(SsdPathInUse):
        DirectoryOwner([str(tmp_path)], "pool-b")
    a2.close()
    b = DirectoryOwner([str(tmp_path)], "pool-b")  # nobody of pool-a holds it any more
    b.close()


def test_a_second_pools_tier_on_the_same_path_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    b, _ = started(cfg)
    try:
        with pytest.raises(SsdPathInUse, match="pool 'p'"):
            EmbeddedBackend(dataclasses.replace(cfg, pool="q")).start()
    finally:
        b.shutdown()
    assert os.path.exists(tmp_path / FILE_NAME.format(slot=0, index=0))


def test_adopted_blocks_join_the_prefix_tree_and_never_shadow_a_block_stored_meanwhile(
        ) -> None:
    index = BlockIndex(cpu_blocks=4, ssd_blocks=4, high=1.0, low=1.0)
    head = index.add_pending(None, [11], [])
    index.publish(head)  # stored again (on the CPU tier) while the recovery ran
    index.reserve_ssd([0, 1, 2])
    assert index.used(Tier.SSD) == 3
    adopted = index.adopt([(11, None, 1, 4),   # already indexed: skipped, block freed
                           (12, 11, 0, 5),     # its child: joins the CPU head
                           (13, 12, 3, 6),     # block 3 was not reserved: refused
                           (14, 99, 2, 7)],    # parent unknown: an orphan
                          [0, 1, 2])
    assert adopted == 1
    index.check_consistency()
    assert len(index.match([11, 12, 13])) == 2
    assert index.location(int(index.match([11, 12])[1])) == BlockLocation(Tier.SSD, 0)
    assert index.used(Tier.SSD) == 1 and sorted(index.free[Tier.SSD]) == [1, 2, 3]


class _HeldReads:
    """Holds the recovery thread's first block read until ``go`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        original = SsdTier._read_into

        def held(tier: SsdTier, index: int, buffer: memoryview) -> int:
            self.entered.set()
            assert self.go.wait(30), "the test never released the recovery"
            return original(tier, index, buffer)

        monkeypatch.setattr(SsdTier, "_read_into", held)


def test_a_flush_during_recovery_abandons_it_and_serves_nothing_old(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(tmp_path)
    prompts, _ = _fill(tmp_path, cfg)
    held = _HeldReads(monkeypatch)
    epoch = [0]
    b = EmbeddedBackend(cfg, cache_epoch=lambda: epoch[0])
    b.start()
    try:
        assert held.entered.wait(30)
        assert b.stats().tiers["ssd"].used_blocks == 3 * BLOCKS  # reserved while checked
        epoch[0] = 1
        b.reset()
        assert b.stats().tiers["ssd"].used_blocks == 0
        held.go.set()
        assert b.recovery_done.wait(30)
        assert b.recovered_blocks == 0 and b.recovery is None
        assert all(b.get_match(p)[0] == -1 for p in prompts)
        b._index.check_consistency()  # type: ignore[union-attr]
    finally:
        held.go.set()
        b.shutdown()
    again, _ = _recovered(dataclasses.replace(cfg, cache_epoch=1))
    try:
        assert again.recovered_blocks == 0  # the flush forgot the records on disk too
    finally:
        again.shutdown()


def test_a_shutdown_during_recovery_stops_it_and_keeps_the_files_for_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(tmp_path)
    prompts, kv = _fill(tmp_path, cfg)
    held = _HeldReads(monkeypatch)
    b = EmbeddedBackend(cfg)
    b.start()
    assert held.entered.wait(30)
    stopper = threading.Thread(target=b.shutdown)
    stopper.start()
    wait_for(lambda: b._closed, "the backend marked closed")
    held.go.set()
    stopper.join(30)
    assert not stopper.is_alive() and b.recovered_blocks == 0
    monkeypatch.undo()
    again, bufs = _recovered(cfg)
    try:
        assert again.recovered_blocks == 3 * BLOCKS
        for p, want in zip(prompts, kv, strict=True):
            _loads_bit_exact(again, bufs, p, want)
    finally:
        again.shutdown()


def test_files_of_the_epoch_a_stage_was_built_under_are_not_recovered_once_it_moved(
        tmp_path: Path) -> None:
    """A flush that lands while a stage is being built: the backend's config names
    the old epoch, the live epoch is already the new one. Nothing written under the
    old epoch is recovered or served."""
    cfg = dataclasses.replace(_cfg(tmp_path), cache_epoch=1)
    prompts, _ = _fill(tmp_path, cfg)
    b = EmbeddedBackend(cfg, cache_epoch=lambda: 2)
    b.start()
    try:
        assert b.recovery_done.wait(30)
        b.register_kv_buffers(0, make_buffers(cfg.layout, 256, seed=99))
        assert b.recovered_blocks == 0
        mask = load(b, prompts[0], np.arange(200, 200 + len(prompts[0]), dtype=np.int64))
        assert int(mask.sum()) == 0
    finally:
        b.shutdown()


def test_a_tier_that_does_not_persist_opening_first_leaves_saved_blocks_to_their_tier(
        tmp_path: Path) -> None:
    """Two tiers share the SSD budget (``ssd_shares=2``): the one without persistence
    opens first after a restart and takes a slot with nothing saved; the persistent
    one then recovers every block it saved, bit-exact."""
    cfg = _cfg(tmp_path, ssd_shares=2)
    prompts, kv = _fill(tmp_path, cfg)
    plain, _ = _recovered(dataclasses.replace(cfg, ssd_persist=False))
    try:
        assert plain.store.ssd is not None and plain.store.ssd.slot == 1
        b, bufs = _recovered(cfg)
        try:
            assert b.store.ssd is not None and b.store.ssd.slot == 0
            assert b.recovered_blocks == len(prompts) * BLOCKS
            for p, want in zip(prompts, kv, strict=True):
                _loads_bit_exact(b, bufs, p, want)
        finally:
            b.shutdown()
    finally:
        plain.shutdown()


def test_a_tier_that_does_not_persist_reclaims_a_saved_slot_only_when_the_budget_has_no_other(
        tmp_path: Path) -> None:
    """With the whole SSD budget one tier's (``ssd_shares=1``) the saved slot is the
    only one within it: a tier without persistence takes it, truncates its blocks and
    removes its records, so nothing saved there is ever recovered."""
    cfg = _cfg(tmp_path)
    _fill(tmp_path, cfg)
    plain, _ = _recovered(dataclasses.replace(cfg, ssd_persist=False))
    try:
        assert plain.store.ssd is not None and plain.store.ssd.slot == 0
        assert not (tmp_path / RECORDS_NAME.format(slot=0)).exists()
        assert not any(plain.store.read_block(BlockLocation(Tier.SSD, 0)))  # truncated
    finally:
        plain.shutdown()
    again, _ = _recovered(cfg)
    try:
        assert again.recovered_blocks == 0
    finally:
        again.shutdown()

"""The index's building blocks: the numpy key table, the free-block ring, and the
vectorised BlockIndex paths (match, run reservation, pending removal, wide hashes)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from node_agent.backend.block_ring import BlockRing
from node_agent.backend.hashing import BlockHasher
from node_agent.backend.index import BlockIndex
from node_agent.backend.key_table import SLOTS, ZERO_STANDIN, KeyTable, as_keys
from node_agent.vocab.placement import Tier, TierMove


def _check_table(table: KeyTable, ref: dict[int, int], rng: np.random.Generator) -> None:
    keys = list(ref)
    if keys:
        assert table.lookup(as_keys(keys)).tolist() == [ref[k] for k in keys]
        assert [table.get(k) for k in keys[:50]] == [ref[k] for k in keys[:50]]
    absent = [int(k) for k in rng.integers(1, 2**63, 64) if int(k) not in ref]
    assert (table.lookup(as_keys(absent)) == -1).all()
    assert len(table) == len(ref) and sorted(table.ids().tolist()) == sorted(ref.values())


def test_key_table_matches_a_dict_under_inserts_and_deletes_with_crowded_buckets() -> None:
    rng = np.random.default_rng(7)
    table = KeyTable(600)
    buckets = len(table._over)
    ref: dict[int, int] = {}
    next_id = 0
    for step in range(200):
        if rng.random() < 0.6 and len(ref) < 550:
            # Half the keys share one home bucket, so buckets overflow into their
            # neighbours and the overflow counts are exercised.
            crowded = [int(x) * buckets + 3 for x in rng.integers(1, 2**40, 6)]
            spread = [int(x) for x in rng.integers(1, 2**63, 6)]
            new = [k for k in dict.fromkeys(crowded + spread) if k not in ref]
            ids = np.arange(next_id, next_id + len(new), dtype=np.int64)
            next_id += len(new)
            table.insert(as_keys(new), ids)
            ref.update(zip(new, ids.tolist(), strict=True))
        elif ref:
            gone = random.Random(step).sample(sorted(ref), min(len(ref), 8))
            if step % 2:
                for k in gone:
                    table.delete(k)
            else:
                keys = as_keys(gone)
                slots = table.find(keys)
                assert (slots >= 0).all()
                table.delete_at(slots, keys)
            for k in gone:
                del ref[k]
        _check_table(table, ref, rng)
    assert table._over.max() > 0  # the crowded bucket did overflow
    for k in list(ref):
        table.delete(k)
    assert not table._over.any() and len(table) == 0  # every overflow count walked back


def test_key_table_refuses_overfill_and_unknown_deletes() -> None:
    table = KeyTable(2)
    table.insert(as_keys([5, 6]), np.array([0, 1]))
    with pytest.raises(OverflowError, match=r"holds 2 of 2 keys; 1 more"):
        table.insert(as_keys([7]), np.array([2]))
    with pytest.raises(KeyError, match="0x7"):
        table.delete(7)
    assert table.get(5) == 0 and table.get(6) == 1


def test_key_zero_is_stored_as_its_stand_in() -> None:
    keys = as_keys([0, 1, 2**64 - 1])
    assert keys.tolist() == [ZERO_STANDIN, 1, 2**64 - 1]
    assert as_keys([2**64 + 5, 2**64], wide=True).tolist() == [5, ZERO_STANDIN]
    table = KeyTable(SLOTS)
    table.insert(keys, np.arange(3))
    assert table.lookup(as_keys([0])).tolist() == [0]


def test_block_ring_is_fifo_across_wraparound() -> None:
    ring = BlockRing(5)
    assert ring.take(3).tolist() == [0, 1, 2]
    ring.extend(np.array([2, 0], dtype=np.int64))
    assert list(ring) == [3, 4, 2, 0]
    assert ring.take(3).tolist() == [3, 4, 2]  # wraps past the end of the buffer
    ring.append(1)
    ring.appendleft(4)
    assert list(ring) == [4, 0, 1] and ring.popleft() == 4 and len(ring) == 2
    ring.extend(np.array([2, 3, 4], dtype=np.int64))
    with pytest.raises(IndexError, match="full; block 9 freed twice"):
        ring.append(9)
    with pytest.raises(IndexError, match="cannot peek 6 blocks"):
        ring.take(6)
    assert sorted(ring.take(5).tolist()) == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError, match="no free block"):
        ring.popleft()


def _stored(index: BlockIndex, hashes: list[int], parent: int | None = None) -> list[int]:
    nodes = index.add_pending(parent, hashes, [])
    index.publish(nodes)
    return nodes.tolist()


def test_match_stops_at_the_first_missing_invisible_or_foreign_block() -> None:
    index = BlockIndex(16, 0, 1.0, 1.0)
    a = _stored(index, [1, 2, 3])
    assert index.match([1, 2, 3, 4]).tolist() == a
    assert index.match([9, 1, 2]).tolist() == []
    pending = index.add_pending(a[-1], [4, 5], [])
    assert index.match([1, 2, 3, 4, 5]).tolist() == a  # 4 and 5 not yet visible
    index.publish(pending)
    assert index.match([1, 2, 3, 4, 5]).tolist() == a + pending.tolist()
    other = _stored(index, [7, 8])
    # 8 is cached, but as a child of 7: a chain 1, 2, 8 must not splice it in.
    assert index.match([1, 2, 8]).tolist() == a[:2]
    assert index.match([7, 8]).tolist() == other
    index.check_consistency()


def test_add_pending_stops_before_a_hash_already_indexed() -> None:
    index = BlockIndex(16, 0, 1.0, 1.0)
    _stored(index, [1, 2])
    created = index.add_pending(None, [10, 11, 2, 12], [])
    assert len(created) == 2  # 2 is cached elsewhere: never shadowed
    assert len(index.add_pending(None, [1], [])) == 0
    index.check_consistency()


def test_removing_a_pending_run_frees_it_and_later_reuse_is_clean() -> None:
    index = BlockIndex(8, 0, 1.0, 1.0)
    root = _stored(index, [1])
    run = index.add_pending(root[0], [2, 3, 4, 5], [])
    assert index.used(Tier.CPU) == 5
    index.remove_pending(run)  # one chain of pending CPU blocks: the vectorised path
    index.check_consistency()
    assert index.used(Tier.CPU) == 1 and index._children[root[0]] == 0
    index.remove_pending(run)  # again: ids no longer filed, nothing happens
    index.check_consistency()
    # Not one chain (two runs of a batch, concatenated): the per-node path.
    r1 = index.add_pending(root[0], [2, 3], [])
    r2 = index.add_pending(None, [20, 21], [])
    index.remove_pending(np.concatenate([r1, r2]))
    index.check_consistency()
    assert not index.contains(20) and not index.contains(3)
    assert index.used(Tier.CPU) == 1 and index._children[root[0]] == 0
    assert len(index.add_pending(None, [30, 31, 32, 33, 34, 35], [])) == 6
    index.check_consistency()


def test_wide_hashes_are_checked_in_full() -> None:
    index = BlockIndex(8, 0, 1.0, 1.0, hash_bits=128)
    low = 12345
    a, b = (1 << 64) | low, (2 << 64) | low  # same low 64 bits, different hashes
    _stored(index, [a])
    assert index.match([a]).tolist() == [0]
    assert index.match([b]).tolist() == []  # the table key matches; the full hash does not
    assert not index.contains(b) and index.contains(a)
    assert len(index.add_pending(None, [b], [])) == 0  # refused like a collision
    index.check_consistency()


def test_eviction_follows_lru_leaves_with_the_new_representation() -> None:
    moved: list[TierMove] = []
    index = BlockIndex(4, 2, 1.0, 1.0, mover=moved.append)
    old = _stored(index, [1, 2])
    new = _stored(index, [3, 4])
    index.touch(index.match([3, 4]))
    moves: list[TierMove] = []
    created = index.add_pending(None, [5, 6, 7], moves)
    assert len(created) == 3
    # The older chain goes first, leaf first: 2 spills, then 1 (no CPU child left
    # then); the SSD is full for the third, so its LRU leaf (2) is dropped for 4.
    summary = [(m.src.tier, m.src.index, None if m.dst is None else m.dst.index) for m in moves]
    assert summary == [(Tier.CPU, 1, 0), (Tier.CPU, 0, 1), (Tier.SSD, 0, None), (Tier.CPU, 3, 0)]
    assert moved == [m for m in moves if m.dst is not None]
    assert index.match([1, 2]).tolist() == old[:1]
    assert index.match([3, 4]).tolist() == new
    index.check_consistency()


def test_hashes_equal_a_plain_chained_xxh3() -> None:
    toks = np.random.default_rng(3).integers(0, 2**40, 16 * 9 + 5, dtype=np.int64)
    want, h = [], 0
    raw = toks.astype("<i8").tobytes()
    for i in range(9):
        h = xxhash.xxh3_64_intdigest(raw[i * 128:(i + 1) * 128], h)
        want.append(h)
    assert BlockHasher(16).hashes(toks) == want
    assert [BlockHasher(16, a).bits for a in ("xxh3_64", "xxh3_128", "blake2b")] == [64, 128, 256]

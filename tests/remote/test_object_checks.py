"""Fetched objects are checked before they are published, against a real
mooncake_master: bytes put under a block's key through a raw Mooncake client (a
corrupted copy, another block's object, garbage, a short object) are never loaded,
and a prefix is never assembled from two writers' bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.backend.cpu_tier import CpuTier
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.hashing import BlockHasher
from node_agent.backend.remote.calls import PendingCall
from node_agent.backend.remote.keys import block_digest
from node_agent.vocab.placement import Tier
from tests.remote.master import Master
from tests.remote.stages import TPB, Node, backend, fill, load, node, rows, store, write_through
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TOKENS = np.arange(9000, 9032, dtype=np.int64)  # 8 blocks of 4 tokens
SRC = np.arange(32, dtype=np.int64)
DST = np.arange(100, 132, dtype=np.int64)


def object_keys(b: EmbeddedBackend, tokens: np.ndarray) -> list[str]:
    """The pool keys of ``tokens``' blocks under ``b``'s key space."""
    assert b.remote is not None
    hashes = BlockHasher(TPB).hashes(tokens)
    return b.remote.keyspace.keys([block_digest(h) for h in hashes])


def replace_object(n: Node, key: str, value: bytes) -> None:
    """Put ``value`` under ``key`` with the node's raw Mooncake client (the removal
    waits out the read lease a get of the object took)."""
    client = n.pool.client()
    assert client is not None
    raw = client._store  # the real Mooncake store object, no checks of ours
    wait_for(lambda: raw.remove(key) == 0, f"the removal of {key}", 60, interval=0.1)
    assert raw.put(key, value) == 0


def raw_object(n: Node, key: str) -> bytes:
    client = n.pool.client()
    assert client is not None
    value = client._store.get(key)
    assert isinstance(value, bytes) and value
    return value


def flip_a_byte(objs: list[bytes], k: int) -> bytes:
    b = bytearray(objs[k])
    b[len(b) - 3] ^= 0x5A  # inside the block's bytes
    return bytes(b)


CORRUPTIONS: dict[str, Callable[[list[bytes], int], bytes]] = {
    "checksum": flip_a_byte,
    "digest": lambda objs, k: objs[k + 1],  # another block's whole object
    "format": lambda objs, k: bytes(np.random.default_rng(k).integers(
        0, 256, len(objs[k]), dtype=np.uint8)),
    "size": lambda objs, k: objs[k][: len(objs[k]) // 2],
}


@pytest.mark.master_lease_ms(500)  # replace_object waits out the reads' leases
@pytest.mark.parametrize("reason", sorted(CORRUPTIONS))
def test_an_object_replaced_under_its_key_in_the_pool_is_never_loaded(
        master: Master, reason: str) -> None:
    """Block 5's object is replaced through a raw Mooncake client: a reader loads
    the five blocks before it bit-exactly, never block 5's replacement nor anything
    after it, and counts the refusal with its reason."""
    a, b = node(master), node(master)
    try:
        ba, bufs_a = backend(a)
        write_through(ba, bufs_a, TOKENS, SRC, seed=31)
        assert ba.remote.written_blocks == 8
        keys = object_keys(ba, TOKENS)
        objs = [raw_object(a, k) for k in keys]
        replace_object(a, keys[5], CORRUPTIONS[reason](objs, 5))

        bb, bufs_b = backend(b)
        fill(bufs_b, DST, seed=32)
        before = rows(bufs_b, DST)
        assert load(bb, TOKENS, DST) == 5 * TPB
        for want, got, old in zip(rows(bufs_a, SRC), rows(bufs_b, DST), before, strict=True):
            assert torch.equal(want[: 5 * TPB], got[: 5 * TPB])
            assert torch.equal(old[5 * TPB:], got[5 * TPB:])  # nothing loaded past it
        get = b.metrics.registry.get_sample_value
        assert get("flexkv_agent_remote_rejected_blocks_total", {"reason": reason}) == 1
        assert get("flexkv_agent_remote_hit_blocks_total") == 5
    finally:
        a.close()
        b.close()


def test_a_prefix_is_never_assembled_from_two_writers(master: Master) -> None:
    """Writers A and C store the same tokens with different bytes (two weights
    versions under one identity): A's put of the first four blocks lands first, so
    the pool holds A[0..3] and, once C stores the whole prompt, C[4..7]. A reader
    loads A's four blocks only, whether it fetches the prompt at once or continues
    a prefix it fetched before; never A's blocks followed by C's."""
    a, b, c, d = node(master), node(master), node(master), node(master)
    try:
        ba, bufs_a = backend(a)
        fill(bufs_a, SRC, seed=41)
        store(ba, TOKENS[: 4 * TPB], SRC[: 4 * TPB])
        assert ba.remote is not None and ba.remote.drain(30)

        bb, bufs_b = backend(b)  # fetches A's four blocks now, continues later
        assert load(bb, TOKENS, DST) == 4 * TPB

        bc, bufs_c = backend(c)
        write_through(bc, bufs_c, TOKENS, SRC, seed=42)

        bd, bufs_d = backend(d)  # fetches the whole prompt at once
        for reader, bufs, n in ((bb, bufs_b, b), (bd, bufs_d, d)):
            assert load(reader, TOKENS, DST) == 4 * TPB
            for want, got in zip(rows(bufs_a, SRC), rows(bufs, DST), strict=True):
                assert torch.equal(want[: 4 * TPB], got[: 4 * TPB])
            assert n.metrics.registry.get_sample_value(
                "flexkv_agent_remote_rejected_blocks_total", {"reason": "writer"}) == 1
        # Control: C's own prompt from C alone is whole.
        assert load(bc, TOKENS, DST) == len(TOKENS)
    finally:
        for n in (a, b, c, d):
            n.close()


def test_a_fetch_staging_one_object_at_a_time_copies_each_block_its_own_bytes(
        master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a fetch half of one object (the smallest ``localBufferSize``) every chunk
    of a fetch lands in the same staging area: the object checked there must be the
    one copied into the CPU tier, never the next chunk's object arriving under it.
    Each copy first waits for every get started so far, as Mooncake's transfer
    threads may finish one at any moment of the copy on a busy node."""
    a, b = node(master), node(master, staging_blocks=1)
    try:
        ba, bufs_a = backend(a)
        write_through(ba, bufs_a, TOKENS, SRC, seed=51)

        bb, bufs_b = backend(b)
        tier = bb.remote
        assert tier is not None and tier.half_blocks == 1
        gets: list[PendingCall[Any]] = []
        submit, scatter = b.pool.submit, tier._scatter

        def tracked_submit(op: str, fn: Callable[[Any], Any],
                           turn: float = 0.0) -> PendingCall[Any] | None:
            call = submit(op, fn, turn)
            if op == "get" and call is not None:
                gets.append(call)
            return call

        def late_scatter(cpu: CpuTier, area: torch.Tensor, cpu_blocks: Sequence[int]) -> None:
            for call in list(gets):
                assert call.done.wait(30), "a get did not end"
            scatter(cpu, area, cpu_blocks)

        monkeypatch.setattr(b.pool, "submit", tracked_submit)
        monkeypatch.setattr(tier, "_scatter", late_scatter)
        assert load(bb, TOKENS, DST) == len(TOKENS)
        assert len(gets) == len(TOKENS) // TPB  # one object per get
        for want, got in zip(rows(bufs_a, SRC), rows(bufs_b, DST), strict=True):
            for blk in range(len(TOKENS) // TPB):
                span = slice(blk * TPB, (blk + 1) * TPB)
                assert torch.equal(want[span], got[span]), f"block {blk} holds other bytes"
        assert b.metrics.registry.get_sample_value(
            "flexkv_agent_remote_rejected_blocks_total", {"reason": "checksum"}) is None
    finally:
        a.close()
        b.close()


def test_a_fetched_prefix_spilled_to_ssd_is_continued_only_by_its_own_writer(
        master: Master, tmp_path: Path) -> None:
    """The reader fetched A's four blocks; the last of them then left the CPU tier
    for the SSD tier (CPU pressure). When C's objects for the rest of the prompt
    arrive, the reader's continuation must still take only A's objects: it loads
    A's four blocks and nothing of C's, as when the prefix stays on the CPU tier."""
    a, b, c = node(master), node(master), node(master)
    try:
        ba, bufs_a = backend(a)
        fill(bufs_a, SRC, seed=61)
        store(ba, TOKENS[: 4 * TPB], SRC[: 4 * TPB])
        assert ba.remote is not None and ba.remote.drain(30)

        bb, bufs_b = backend(b, cpu_blocks=8, ssd_blocks=16, ssd_path=str(tmp_path))
        assert load(bb, TOKENS, DST) == 4 * TPB  # A's four blocks, fetched
        other = TOKENS + 70_000
        fill(bufs_b, SRC, seed=62)
        store(bb, other[: 4 * TPB], SRC[: 4 * TPB])  # CPU pressure: the oldest leaves spill
        index = bb._index
        assert index is not None
        mine = index.match(BlockHasher(TPB).hashes(TOKENS[: 4 * TPB]))
        assert len(mine) == 4 and index.location(int(mine[3])).tier is Tier.SSD

        bc, bufs_c = backend(c)
        fill(bufs_c, SRC, seed=63)
        store(bc, TOKENS, SRC)  # the pool now holds A[0..3] and C[4..7]
        assert bc.remote is not None and bc.remote.drain(30)

        fill(bufs_b, DST, seed=64)
        before = rows(bufs_b, DST)
        assert load(bb, TOKENS, DST) == 4 * TPB
        for want, got, old in zip(rows(bufs_a, SRC), rows(bufs_b, DST), before, strict=True):
            assert torch.equal(want[: 4 * TPB], got[: 4 * TPB])
            assert torch.equal(old[4 * TPB:], got[4 * TPB:])  # nothing of C's loaded
        assert b.metrics.registry.get_sample_value(
            "flexkv_agent_remote_rejected_blocks_total", {"reason": "writer"}) == 1
    finally:
        for n in (a, b, c):
            n.close()

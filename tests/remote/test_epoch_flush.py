"""Cache epoch flushes against a real mooncake_master: bytes cached before a flush are
never written under (or loaded from) the new epoch's keys."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tests.remote.master import Master
from tests.remote.stages import backend, fill, load, node, rows, store, write_through

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TOKENS = np.arange(7000, 7032, dtype=np.int64)  # 8 blocks of 4 tokens
SRC = np.arange(32, dtype=np.int64)
DST = np.arange(100, 132, dtype=np.int64)


def test_a_write_queued_before_an_epoch_flush_never_lands_under_the_new_epoch(
        master: Master) -> None:
    """agent.flush switches the key epoch first, then resets the stages: a block
    offered before the switch and written after it carries old-epoch bytes and must
    not be stored under a new-epoch key."""
    a, b = node(master), node(master)
    epoch = [0]
    try:
        ba, bufs = backend(a, key_epoch=lambda: epoch[0])
        tier = ba.remote
        assert tier is not None
        writer = tier._writer
        assert writer is not None
        gate, held = threading.Event(), threading.Event()
        flush = writer._flush

        def gated(batch):  # type: ignore[no-untyped-def]
            held.set()
            assert gate.wait(60)
            flush(batch)

        writer._flush = gated
        fill(bufs, SRC, seed=11)
        store(ba, TOKENS, SRC)  # epoch 0 bytes, offered to the writer
        assert held.wait(30), "the writer did not take the batch"
        epoch[0] = 1  # agent.flush: key epoch first ...
        gate.set()
        assert tier.drain(30)
        ba.reset()  # ... then the stage reset

        reader, _ = backend(b, epoch=1)
        assert reader.get_match(TOKENS)[0] == -1, "old-epoch bytes found under epoch 1"
        assert reader.remote is not None and reader.remote.fetched_blocks == 0

        # Control: a block stored after the flush is written under epoch 1 and served.
        fill(bufs, SRC, seed=12)
        store(ba, TOKENS, SRC)
        assert tier.drain(30)
        fresh, fresh_bufs = backend(b, epoch=1)
        assert load(fresh, TOKENS, DST) == len(TOKENS)
        for want, got in zip(rows(bufs, SRC), rows(fresh_bufs, DST), strict=True):
            assert torch.equal(want, got)
    finally:
        a.close()
        b.close()


def test_a_reset_during_a_remote_fetch_never_lets_the_fetch_overwrite_reused_blocks(
        master: Master) -> None:
    """A reset clears the index while get_match is fetching into reserved CPU blocks;
    blocks a new put then stores must keep the engine's bytes (the fetch must stop
    writing CPU blocks once the stage was reset), locally and in the pool."""
    a = node(master)
    b = node(master, staging_blocks=4)  # fetches go 2 blocks per chunk
    c = node(master)
    try:
        ba, bufs_a = backend(a)
        write_through(ba, bufs_a, TOKENS, SRC, seed=21)

        bb, bufs_b = backend(b)
        other = TOKENS + 50_000
        fill(bufs_b, SRC, seed=22)
        want = rows(bufs_b, SRC)
        calls: list[int] = []

        def reset_and_reuse(done: int) -> None:
            calls.append(done)
            if len(calls) == 1:
                bb.reset()  # e.g. a cacheEpoch flush on another thread
                store(bb, other, SRC)  # reuses the CPU blocks the fetch reserved

        bb.remote_fetch_hook = reset_and_reuse
        bb.get_match(TOKENS)
        bb.remote_fetch_hook = None
        assert calls and calls[0] == 2
        assert load(bb, other, DST) == len(other)
        for w, got in zip(want, rows(bufs_b, DST), strict=True):
            assert torch.equal(w, got), "a fetch overwrote a block stored after the reset"
        # Nor does the write-behind store the fetched bytes under the new block's key.
        assert bb.remote is not None and bb.remote.drain(30)
        bc, bufs_c = backend(c)
        assert load(bc, other, DST) == len(other)
        for w, got in zip(want, rows(bufs_c, DST), strict=True):
            assert torch.equal(w, got), "the pool holds fetched bytes under another key"
    finally:
        a.close()
        b.close()
        c.close()


def test_a_key_epoch_switch_in_the_middle_of_a_fetch_never_mixes_epochs(
        master: Master) -> None:
    """The blocks of one fetch all come from the key epoch of its lookup: a prefix
    never continues with blocks of another epoch."""
    a, b = node(master), node(master, staging_blocks=4)  # 2 blocks per chunk
    try:
        b0, bufs0 = backend(a, epoch=0)
        write_through(b0, bufs0, TOKENS, SRC, seed=31)
        b1, bufs1 = backend(a, epoch=1)
        write_through(b1, bufs1, TOKENS, SRC, seed=32)
        assert b0.remote.written_blocks == b1.remote.written_blocks == len(TOKENS) // 4
        want0 = rows(bufs0, SRC)

        epoch = [0]
        reader, bufs_r = backend(b, key_epoch=lambda: epoch[0])
        tier = reader.remote
        assert tier is not None

        def switch(done: int) -> None:
            epoch[0] = 1

        reader.remote_fetch_hook = switch
        tid, mask = reader.get_match(TOKENS)
        reader.remote_fetch_hook = None
        hit = int(mask.sum())
        assert tid >= 0 and hit >= 2 * 4
        [tid] = reader.launch([tid], [DST[:hit]])
        assert reader.wait([tid], timeout=20)[tid].status.value == "success"
        for w, got in zip(want0, rows(bufs_r, DST[:hit]), strict=True):
            assert torch.equal(w[:hit], got), "a fetched prefix mixes two epochs"
    finally:
        a.close()
        b.close()


def test_a_put_that_overran_its_timeout_never_sends_the_next_batchs_bytes(
        master: Master) -> None:
    """A put that outlives its timeout still reads the write staging area until the
    native call returns: the next batch must not be copied into that area meanwhile,
    or the late put stores the next batch's bytes under the first batch's keys."""
    a = node(master, timeout=1.0)
    b = node(master)
    try:
        ba, bufs_a = backend(a)
        client = a.pool.client()
        assert client is not None
        real_put = client.batch_put_from
        gate, held = threading.Event(), threading.Event()

        def slow_first_put(keys, ptrs, sizes):  # type: ignore[no-untyped-def]
            if not held.is_set():
                held.set()
                assert gate.wait(60)  # a peer that answers late
            return real_put(keys, ptrs, sizes)

        client.batch_put_from = slow_first_put  # type: ignore[method-assign]
        fill(bufs_a, SRC, seed=41)
        want = rows(bufs_a, SRC)
        store(ba, TOKENS, SRC)
        assert held.wait(30), "the first put did not start"
        other = TOKENS + 90_000
        fill(bufs_a, DST, seed=42)
        store(ba, other, DST)
        assert ba.remote is not None and ba.remote.drain(30)  # the first put timed out
        gate.set()
        lane = a.pool._lanes["put"]
        for _ in range(600):
            if not lane.busy():
                break
            threading.Event().wait(0.05)
        assert not lane.busy()

        bb, bufs_b = backend(b)
        hit = load(bb, TOKENS, DST)
        assert hit == len(TOKENS), "the late put of the first batch was lost"
        for w, got in zip(want, rows(bufs_b, DST), strict=True):
            assert torch.equal(w, got), "a late put stored another batch's bytes"
    finally:
        gate.set()
        a.close()
        b.close()

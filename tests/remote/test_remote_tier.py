"""The remote tier against a real mooncake_master on loopback: two nodes (each its own
Mooncake client, CPU tier and engine buffers) sharing one pool."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from node_agent.backend.remote.objects import HEADER_BYTES
from node_agent.backend.remote.settings import RemoteSettings
from node_agent.backend.remote.tier import RemotePool
from node_agent.pp import messages
from node_agent.vocab.layout import KVDtype
from node_agent.vocab.placement import Tier, TierMove
from tests.remote.master import Master
from tests.remote.stages import (
    LAYOUT,
    TPB,
    backend,
    fill,
    follower,
    load,
    node,
    rows,
    store,
    write_through,
)
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TOKENS = np.arange(5000, 5064, dtype=np.int64)  # 16 blocks of 4 tokens
SRC = np.arange(64, dtype=np.int64)
DST = np.arange(100, 164, dtype=np.int64)


def test_a_prefix_stored_on_one_node_is_served_on_another_bit_exactly(master: Master) -> None:
    a, b = node(master), node(master)
    try:
        ba, bufs_a = backend(a)
        bb, bufs_b = backend(b)
        write_through(ba, bufs_a, TOKENS, SRC, seed=1)
        assert ba.remote.written_blocks == 16
        assert load(bb, TOKENS, DST) == len(TOKENS)
        for want, got in zip(rows(bufs_a, SRC), rows(bufs_b, DST), strict=True):
            assert torch.equal(want, got)
        # Now local on B: a second lookup hits the CPU tier without fetching again.
        assert bb.remote is not None
        fetched = bb.remote.fetched_blocks
        assert load(bb, TOKENS, DST) == len(TOKENS)
        assert bb.remote.fetched_blocks == fetched == 16
        get = b.metrics.registry.get_sample_value
        assert get("flexkv_agent_remote_hit_blocks_total") == 16
        assert get("flexkv_agent_remote_bytes_total", {"direction": "get"}) == \
            16 * LAYOUT.bytes_per_block
        assert get("flexkv_agent_remote_up") == 1
    finally:
        a.close()
        b.close()


def test_a_block_of_another_layout_namespace_pool_or_epoch_is_never_loaded(
        master: Master) -> None:
    a, b = node(master), node(master)
    try:
        ba, bufs_a = backend(a)
        write_through(ba, bufs_a, TOKENS, SRC, seed=2)
        # Same bytes per block, other dtype: the bytes would be misread.
        bf16 = dataclasses.replace(LAYOUT, dtype=KVDtype.BFLOAT16)
        assert bf16.bytes_per_block == LAYOUT.bytes_per_block
        others = [backend(b, layout=bf16)[0], backend(b, namespace="ns2")[0],
                  backend(b, pool="other")[0], backend(b, epoch=1)[0],
                  backend(b, pp_rank=1, pp_size=2)[0]]
        for other in others:
            assert other.get_match(TOKENS)[0] == -1
            assert other.remote is not None and other.remote.fetched_blocks == 0
        same, bufs_same = backend(b)
        assert load(same, TOKENS, DST) == len(TOKENS)  # the control: the same key space hits
        for want, got in zip(rows(bufs_a, SRC), rows(bufs_same, DST), strict=True):
            assert torch.equal(want, got)
    finally:
        a.close()
        b.close()


def test_master_killed_mid_fetch_is_a_shorter_hit_without_a_hole_then_hits_resume(
        master: Master) -> None:
    a = node(master)
    b = node(master, staging_blocks=8, timeout=3.0)  # fetches go 4 blocks per chunk
    try:
        ba, bufs_a = backend(a)
        bb, bufs_b = backend(b)
        write_through(ba, bufs_a, TOKENS, SRC, seed=3)
        calls: list[int] = []

        def kill_after_first_chunk(done: int) -> None:
            calls.append(done)
            master.kill()

        bb.remote_fetch_hook = kill_after_first_chunk
        t0 = time.monotonic()
        tid, mask = bb.get_match(TOKENS)
        elapsed = time.monotonic() - t0
        bb.remote_fetch_hook = None
        assert calls == [4]
        assert elapsed < 60  # bounded (the call budget is 3 s; generous for a loaded machine)
        assert tid >= 0 and int(mask.sum()) == 4 * TPB and mask[: 4 * TPB].all()
        [tid] = bb.launch([tid], [DST[: 4 * TPB]])
        assert bb.wait([tid], timeout=20)[tid].status.value == "success"
        for want, got in zip(rows(bufs_a, SRC[:16]), rows(bufs_b, DST[:16]), strict=True):
            assert torch.equal(want, got)
        # No partial block stayed behind: only the 4 fetched blocks are indexed.
        assert bb.stats().tiers["cpu"].used_blocks == 4
        # Master down: lookups are local hits only, and answer.
        tid2, mask2 = bb.get_match(TOKENS)
        assert int(mask2.sum()) == 4 * TPB
        bb.cancel([tid2])
        assert b.pool.health.up is False
        assert b.metrics.registry.get_sample_value("flexkv_agent_remote_up") == 0

        # The master returns (empty): a prompt stored after that is served again.
        master.start()
        tokens2 = TOKENS + 10_000
        fill(bufs_a, SRC, seed=4)

        def stored_and_written() -> bool:
            tid, mask = ba.put_match(tokens2)
            if tid >= 0:
                [tid] = ba.launch([tid], [SRC[mask]])
                ba.wait([tid], timeout=20)
            assert ba.remote is not None
            ba.remote.drain(30)
            if bb.get_match(tokens2)[0] >= 0:
                return True
            # Writes dropped while the clients re-joined: evict and store again.
            ba.reset()
            return False

        wait_for(stored_and_written, "hits after the master restarted", 90, interval=0.05)
        assert b.pool.health.up
    finally:
        a.close()
        b.close()


def _stage_bytes(bufs: tuple[list[torch.Tensor], ...], slots: np.ndarray) -> list[torch.Tensor]:
    return rows(bufs, slots)


def test_two_stage_groups_fetch_each_stage_its_own_keys(master: Master) -> None:
    """Group A (leader stage 0 + follower stage 1) stores; group B serves the prefix from
    the remote tier: B's leader decides, its REMOTE -> CPU moves travel through the
    fan-out wire encoding, and each B stage fetches its own stage's bytes."""
    a0, a1, b0, b1 = (node(master) for _ in range(4))
    try:
        lead_a, bufs_a0 = backend(a0, pp_rank=0, pp_size=2, deferred=True)
        fol_a, bufs_a1 = follower(a1, LAYOUT, pp_rank=1, pp_size=2)
        lead_b, bufs_b0 = backend(b0, pp_rank=0, pp_size=2, deferred=True)
        fol_b, bufs_b1 = follower(b1, LAYOUT, pp_rank=1, pp_size=2)
        fill(bufs_a0, SRC, seed=5)
        fill(bufs_a1, SRC, seed=6)  # each stage holds other layers: other bytes

        def wire(moves: list[TierMove]) -> tuple[TierMove, ...]:
            env = messages.Envelope(messages.Op.MOVES, group="g", epoch=1, seq=1)
            msg = messages.decode(messages.encode(env, messages.Moves(tuple(moves))))
            assert isinstance(msg.body, messages.Moves)
            return msg.body.moves

        # Group A stores: both stages copy, the leader publishes, the CPU -> REMOTE moves
        # tell the follower to write its own blocks.
        tid, mask = lead_a.put_match(TOKENS)
        plan = lead_a.plan_of(tid)
        fol_a.apply_moves(wire(lead_a.drain_moves()))
        [tid] = lead_a.launch([tid], [SRC[mask]])
        assert lead_a.wait([tid], timeout=20)[tid].status.value == "success"
        fol_a.execute(plan, SRC[mask], timeout=20)
        lead_a.publish(tid)
        writes = lead_a.drain_moves()
        assert [m.dst.tier for m in writes if m.dst is not None] == [Tier.REMOTE] * 16
        fol_a.apply_moves(wire(writes))
        assert lead_a.remote is not None and fol_a.remote is not None
        assert lead_a.remote.drain(30) and fol_a.remote.drain(30)
        assert fol_a.remote.written_blocks == 16

        # Group B: the leader's lookup fetches its stage, the moves make the follower
        # fetch its own, then both load.
        tid, mask = lead_b.get_match(TOKENS)
        assert int(mask.sum()) == len(TOKENS)
        plan = lead_b.plan_of(tid)
        fetches = wire(lead_b.drain_moves())
        assert [m.src.tier for m in fetches] == [Tier.REMOTE] * 16
        fol_b.apply_moves(fetches)
        assert fol_b.remote is not None and fol_b.remote.fetched_blocks == 16
        [tid] = lead_b.launch([tid], [DST])
        assert lead_b.wait([tid], timeout=20)[tid].status.value == "success"
        fol_b.execute(plan, DST, timeout=20)
        for want, got in zip(rows(bufs_a0, SRC), rows(bufs_b0, DST), strict=True):
            assert torch.equal(want, got)
        for want, got in zip(rows(bufs_a1, SRC), rows(bufs_b1, DST), strict=True):
            assert torch.equal(want, got)
        assert not all(torch.equal(x, y) for x, y in
                       zip(rows(bufs_b0, DST), rows(bufs_b1, DST), strict=True))
    finally:
        for n in (a0, a1, b0, b1):
            n.close()


def test_a_follower_whose_fetch_fails_never_loads_the_block(master: Master) -> None:
    """The leader found its stage's blocks but the follower's are missing: the
    follower's load fails (a miss for the group), it never loads undefined bytes."""
    a0, b0, b1 = node(master), node(master), node(master)
    try:
        lead_a, bufs_a0 = backend(a0, pp_rank=0, pp_size=2, deferred=True)
        lead_b, _ = backend(b0, pp_rank=0, pp_size=2, deferred=True)
        fol_b, _ = follower(b1, LAYOUT, pp_rank=1, pp_size=2)
        fill(bufs_a0, SRC, seed=7)
        tid, mask = lead_a.put_match(TOKENS)
        [tid] = lead_a.launch([tid], [SRC[mask]])
        lead_a.wait([tid], timeout=20)
        lead_a.publish(tid)  # stage 1 of group A never wrote its blocks
        assert lead_a.remote is not None and lead_a.remote.drain(30)
        tid, mask = lead_b.get_match(TOKENS)
        assert int(mask.sum()) == len(TOKENS)
        plan = lead_b.plan_of(tid)
        fol_b.apply_moves(lead_b.drain_moves())
        with pytest.raises(ValueError, match="fetch from the remote tier failed"):
            fol_b.execute(plan, DST, timeout=20)
    finally:
        for n in (a0, b0, b1):
            n.close()


def test_a_node_whose_master_is_down_at_start_joins_when_it_comes_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    m = Master(tmp_path / "late-master.log")
    pool = RemotePool(RemoteSettings(
        m.address, m.metadata, f"127.0.0.1:{free_port()}", segment_bytes=16 << 20,
        staging_bytes=1 << 20, timeout_seconds=2), retry_seconds=0.2)
    try:
        pool.start(30)
        assert pool.health.up is False
        assert pool.call("lookup", lambda c: c.batch_is_exist(["k"]), 2) is None  # a miss
        m.start()
        wait_for(lambda: pool.call("lookup", lambda c: c.batch_is_exist(["k"]), 2) == [0],
                 "joined once the master is up", 90, interval=0.05)
        assert pool.health.up
    finally:
        pool.close()
        m.kill()


def test_evict_policy_writes_blocks_leaving_the_cpu_tier_and_never_stale_bytes(
        master: Master) -> None:
    """``writePolicy: evict``: nothing is written on store; the blocks a later put
    evicts are. A block whose CPU copy is reused before the writer took it is
    dropped, never written with the new content under the old key."""
    a, b = node(master, write_policy="evict"), node(master)
    try:
        ba, bufs_a = backend(a, cpu_blocks=16)
        bb, bufs_b = backend(b)
        assert ba.remote is not None
        first, second, third = TOKENS, TOKENS + 100_000, TOKENS + 200_000
        fill(bufs_a, SRC, seed=8)
        store(ba, first, SRC)
        assert ba.remote.drain(30) and ba.remote.written_blocks == 0
        want_first = rows(bufs_a, SRC)
        # The second prompt evicts the first (16-block tier): the writer copies the
        # evicted blocks out before the new put's copy overwrites them.
        tid, mask = ba.put_match(second)
        assert ba.remote.drain(30)
        assert ba.remote.written_blocks == 16
        fill(bufs_a, SRC, seed=9)
        [tid] = ba.launch([tid], [SRC[mask]])
        assert ba.wait([tid], timeout=20)[tid].status.value == "success"
        assert load(bb, first, DST) == len(first)
        for want, got in zip(want_first, rows(bufs_b, DST), strict=True):
            assert torch.equal(want, got)
        # The third prompt evicts the second, but its copy runs before the writer:
        # whatever reached the pool must be the second prompt's bytes.
        want_second = rows(bufs_a, SRC)
        written = ba.remote.written_blocks
        fill(bufs_a, SRC, seed=10)
        store(ba, third, SRC)
        assert ba.remote.drain(30)
        dropped = a.metrics.registry.get_sample_value(
            "flexkv_agent_remote_dropped_blocks_total", {"reason": "overwritten"}) or 0
        assert (ba.remote.written_blocks - written) + dropped == 16
        hit = load(bb, second, DST)
        assert hit % TPB == 0
        for want, got in zip(want_second, rows(bufs_b, DST), strict=True):
            assert torch.equal(want[:hit], got[:hit])
    finally:
        a.close()
        b.close()


def test_a_lookup_asks_for_the_rest_only_when_its_head_exists(
        master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first ``batch_is_exist`` asks for the first ``LOOKUP_HEAD`` blocks; the
    rest only when all of those exist. A prompt whose first block the pool lacks is
    one call of the head; a run that ends past the head, at the head's end or
    inside it is counted exactly."""
    from node_agent.backend.remote import tier as tier_mod

    monkeypatch.setattr(tier_mod, "LOOKUP_HEAD", 4)
    a, b = node(master), node(master)
    try:
        ba, bufs_a = backend(a)
        write_through(ba, bufs_a, TOKENS[: 10 * TPB], SRC[: 10 * TPB], seed=81)
        bb, _ = backend(b)
        remote = bb.remote
        assert remote is not None
        calls: list[int] = []
        real = b.pool.call

        def counted(op, fn, timeout):  # type: ignore[no-untyped-def]
            if op == "lookup":
                calls.append(0)
            return real(op, fn, timeout)

        monkeypatch.setattr(b.pool, "call", counted)
        ids = [h & ((1 << 128) - 1) for h in bb._hasher.hashes(TOKENS)]
        assert remote.lookup(ids, 5.0) == 10 and len(calls) == 2  # past the head
        calls.clear()
        assert remote.lookup(ids[:4], 5.0) == 4 and len(calls) == 1  # the head is all
        calls.clear()
        other = [h & ((1 << 128) - 1) for h in bb._hasher.hashes(TOKENS + 9_000)]
        assert remote.lookup(other, 5.0) == 0 and len(calls) == 1  # cached nowhere
        calls.clear()
        assert remote.lookup(ids[:3] + other, 5.0) == 3 and len(calls) == 1  # ends in the head
        calls.clear()
        assert remote.lookup(ids[:4] + other, 5.0) == 4 and len(calls) == 2  # at its end

        # Both calls of one lookup use the key epoch of its start: an epoch switch
        # between them neither finds the old epoch's rest under new keys nor mixes.
        epoch = [0]
        bc, _ = backend(b, key_epoch=lambda: epoch[0])
        assert bc.remote is not None
        calls.clear()

        def switching(op, fn, timeout):  # type: ignore[no-untyped-def]
            out = counted(op, fn, timeout)
            epoch[0] += 1  # after each call
            return out

        monkeypatch.setattr(b.pool, "call", switching)
        assert bc.remote.lookup(ids, 5.0) == 10 and len(calls) == 2
        assert bc.remote.lookup(ids, 5.0) == 0  # epoch 2: nothing of it is stored
    finally:
        a.close()
        b.close()


def test_a_fetch_in_many_chunks_into_scattered_cpu_blocks_is_bit_exact(
        master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of three objects (the fetch's chunk size lowered: six gets, the two
    staging areas alternating) into CPU blocks in no order, with consecutive runs
    inside some chunks: every CPU block holds exactly its own block's bytes."""
    from node_agent.backend.remote import tier as tier_mod

    a, b = node(master), node(master)
    try:
        ba, bufs_a = backend(a)
        write_through(ba, bufs_a, TOKENS, SRC, seed=91)
        bb, _ = backend(b)
        remote, index = bb.remote, ba._index
        assert remote is not None and remote._cpu is not None and index is not None
        assert ba.remote is not None and ba.remote._cpu is not None
        monkeypatch.setattr(tier_mod, "FETCH_CHUNK_BYTES", 3 * remote.object_bytes)
        gets: list[int] = []
        submit = b.pool.submit

        def tracked(op, fn, turn=0.0):  # type: ignore[no-untyped-def]
            if op == "get":
                gets.append(0)
            return submit(op, fn, turn)

        monkeypatch.setattr(b.pool, "submit", tracked)
        hashes = ba._hasher.hashes(TOKENS)
        ids = [h & ((1 << 128) - 1) for h in hashes]
        targets = [90, 3, 4, 5, 77, 20, 21, 8, 60, 61, 62, 63, 1, 100, 30, 31]
        assert remote.fetch(ids, targets, 5.0) == 16
        assert len(gets) == 6  # 16 blocks in chunks of 3
        held = index.locations(index.match(hashes, index.keys(hashes)))
        for i, (loc, cpu_block) in enumerate(zip(held, targets, strict=True)):
            assert remote._cpu.read_block(cpu_block) == ba.remote._cpu.read_block(loc.index), \
                f"block {i} in CPU block {cpu_block} holds other bytes"
        # The write path's copy out of scattered CPU blocks is the inverse.
        area = torch.zeros(len(targets) * remote.object_bytes, dtype=torch.uint8)
        remote._gather(remote._cpu, area, targets)
        objs = area.numpy().reshape(len(targets), remote.object_bytes)
        for i, cpu_block in enumerate(targets):
            assert objs[i, HEADER_BYTES:].tobytes() == remote._cpu.read_block(cpu_block)
        with pytest.raises(IndexError, match="outside"):
            remote._gather(remote._cpu, area, [3, 1, 10_000])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("targets", [[5, -1], [-2, -1], [3, 1, 10_000]])
def test_a_fetch_into_a_cpu_block_outside_the_tier_moves_no_byte(
        master: Master, targets: list[int]) -> None:
    """CPU blocks outside the tier (negative ones too, which numpy would read
    from the end) are refused with ``IndexError`` before any byte moves: no
    other CPU block is overwritten and nothing is counted as fetched."""
    a, b = node(master), node(master)
    try:
        ba, bufs_a = backend(a)
        write_through(ba, bufs_a, TOKENS, SRC, seed=92)
        bb, _ = backend(b)
        remote = bb.remote
        assert remote is not None and remote._cpu is not None
        ids = [h & ((1 << 128) - 1) for h in ba._hasher.hashes(TOKENS)][:len(targets)]
        cpu = remote._cpu
        before = [cpu.read_block(i) for i in range(cpu.num_blocks)]
        with pytest.raises(IndexError):
            remote.fetch(ids, targets, 5.0)
        assert [cpu.read_block(i) for i in range(cpu.num_blocks)] == before
        assert remote.fetched_blocks == 0
    finally:
        a.close()
        b.close()

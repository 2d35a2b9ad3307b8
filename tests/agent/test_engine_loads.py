"""Engine-side loads through a real agent and its real ipc socket: the engine claims
a looked-up load (``claim_load``), copies it from the agent's shared CPU tier with
:class:`~node_agent.engine_loads.EngineLoads` and commits it (``commit_load``).
The slots are the stored KV bit for bit, as a ``retrieve`` fills them; whatever
ends the claim before the commit (a release of the rid, the lease ending while the
copy is paused) makes the load a miss; calls out of order are refused with named
errors; the tier's descriptor comes from the agent's tier socket beside its
engine socket; a restarted agent refuses its predecessor's tier id and hands out
a new tier that the engine maps again; a tensor-parallel stage hands out nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.cpu_tier import read_only_fd
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.stage_store import TierStore
from node_agent.backend.tier_fds import receive_tier_fd, tier_socket_path
from node_agent.client import EngineAPIError, EngineClient, RankInfo, SharedKVBuffers
from node_agent.coordinator import Coordinator, CoordinatorConfig
from node_agent.coordinator.leader import LeaderRole
from node_agent.engine_loads import EngineLoads
from node_agent.vocab.layout import KVDtype, KVLayout
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    agent_mapping,
    cfg_of,
    launch_agent,
    running_agent,
    stop_process,
)
from tests.coordinator.harness import solo_view
from tests.coordinator.pairs import InProcessGroup
from tests.support.ports import free_port
from tests.support.waiting import wait_for, wait_for_async

pytestmark = pytest.mark.timeout(180)

RANK = RankInfo(replica="solo-0")
PROMPT = np.arange(5000, 5032, dtype=np.int64)  # 8 blocks
SRC = np.arange(32, dtype=np.int64)


def planes(bufs: SharedKVBuffers) -> list[torch.Tensor]:
    return [t for g in bufs.tensors for t in g]


def fill_slots(bufs: SharedKVBuffers, slots: np.ndarray, salt: int) -> None:
    """Distinct values in every plane of ``slots`` (the engine's forward)."""
    idx = torch.as_tensor(slots)
    for i, t in enumerate(planes(bufs)):
        vals = torch.arange(len(slots) * t[0].numel(), dtype=torch.float32).view(
            len(slots), *t.shape[1:]) + 1000 * i + 7 * salt
        t[idx] = vals.to(t.dtype)


def equal_slots(bufs: SharedKVBuffers, a: np.ndarray, b: np.ndarray) -> bool:
    ia, ib = torch.as_tensor(a), torch.as_tensor(b)
    return all(torch.equal(t[ia].view(torch.uint8), t[ib].view(torch.uint8))
               for t in planes(bufs))


def zero_slots(bufs: SharedKVBuffers, slots: np.ndarray) -> None:
    for t in planes(bufs):
        t[torch.as_tensor(slots)] = 0


def store_prompt(client: EngineClient, bufs: SharedKVBuffers, rid: str,
                 prompt: np.ndarray = PROMPT, src: np.ndarray = SRC, salt: int = 0) -> None:
    """Store ``prompt``'s KV from ``src`` and wait until the agent reports it stored
    (blocking: call from a worker thread)."""
    fill_slots(bufs, src, salt)
    assert client.store_kv(rid, prompt, src) >= 0
    for _ in range(30):
        if rid in client.wait_completed(1.0):
            break
    else:
        raise AssertionError(f"the store {rid!r} never completed")
    client.release(rid)


@dataclass
class Solo:
    """A single-stage agent served in this event loop, an engine client registered
    with it, the engine's buffers (PROMPT's KV stored from SRC) and its loads."""

    ra: Any
    client: EngineClient
    bufs: SharedKVBuffers
    loads: EngineLoads
    socket: str


@contextlib.asynccontextmanager
async def solo(work: Path, **extra: Any) -> AsyncIterator[Solo]:
    """:class:`Solo` for ``agent_mapping(work, "solo", **extra)``; closed on exit."""
    cfg = cfg_of(agent_mapping(work, "solo", **extra))
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    try:
        async with running_agent(cfg) as ra:
            client = EngineClient(cfg.engine_socket, RANK, timeout=10)
            loads = EngineLoads(client, LAYOUT, bufs.tensors)
            try:
                await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)
                await asyncio.to_thread(store_prompt, client, bufs, "s")
                yield Solo(ra, client, bufs, loads, cfg.engine_socket)
            finally:
                loads.close()
                client.close()
    finally:
        bufs.close()


def _tier_id(ra: Any) -> str:
    """The id of the shared CPU tier of the agent's only stage."""
    handle = _backend(ra).tier_handle()
    assert handle is not None and handle["kind"] == "memfd"
    return str(handle["id"])


async def test_an_engine_copied_load_is_the_stored_kv_like_a_retrieve(
        work: Path) -> None:
    async with solo(work) as e:
        client, bufs, loads = e.client, e.bufs, e.loads
        dst = np.arange(64, 96, dtype=np.int64)
        zero_slots(bufs, dst)
        assert await asyncio.to_thread(client.lookup, "e", PROMPT) == 32
        assert await asyncio.to_thread(loads.load, "e", dst) == 32
        assert equal_slots(bufs, SRC, dst)
        assert (loads.loads, loads.misses) == (1, 0)
        # The tier it mapped is the agent's, received from the tier socket beside
        # the engine socket.
        tier_id = _tier_id(e.ra)
        assert loads._tier is not None and loads._tier.tier_id == tier_id
        assert loads.tier_socket == tier_socket_path(e.socket) == e.socket + ".tier"
        assert os.path.exists(loads.tier_socket)
        # A retrieve of the same prompt fills other slots with the same bytes.
        ret = np.arange(128, 160, dtype=np.int64)
        zero_slots(bufs, ret)
        assert await asyncio.to_thread(client.lookup, "r", PROMPT) == 32
        assert await asyncio.to_thread(client.retrieve, "r", ret) == 32
        assert equal_slots(bufs, dst, ret)
        # A partial hit loads its prefix only, into one slot per hit token.
        longer = np.concatenate([PROMPT[:16], np.arange(9000, 9016, dtype=np.int64)])
        assert await asyncio.to_thread(client.lookup, "p", longer) == 16
        part = np.arange(200, 216, dtype=np.int64)
        assert await asyncio.to_thread(loads.load, "p", part) == 16
        assert equal_slots(bufs, SRC[:16], part)
        # No claim ended early, so the claim fence said both held: their commits
        # went out without waiting, and a call after them is answered after them.
        assert loads.fenced == 2
        await asyncio.to_thread(client.ping)
        # The claims ended: nothing stays pinned, a commit again is refused.
        assert _locked(_backend(e.ra)) == 0
        with pytest.raises(EngineAPIError, match="claim_load first"):
            await asyncio.to_thread(client.commit_load, "e")
    # The agent's shutdown closed its tier and removed its tier socket.
    assert read_only_fd(tier_id) is None
    assert not os.path.exists(e.socket + ".tier")


async def test_a_stage_answering_commits_on_workers_hands_out_no_fence(work: Path) -> None:
    """Where ``commit_load`` takes a worker (a stage whose calls do not run on the
    I/O thread), a commit sent without waiting could be overtaken by the engine's
    next call (its release) or refused as busy: no fence is handed out, and every
    load waits for its commit's answer."""
    async with solo(work) as e:
        client, bufs, loads, backend = e.client, e.bufs, e.loads, _backend(e.ra)
        [stage] = e.ra.agent.service.stages.values()
        assert "commit_load" in stage.inline_ops
        stage.inline_ops = stage.inline_ops - {"commit_load"}
        dst = np.arange(64, 96, dtype=np.int64)
        zero_slots(bufs, dst)
        got = await asyncio.to_thread(client.lookup_claim, "w", PROMPT)
        assert got["hit"] == 32 and got["blocks"] and got["fence"] is None
        await asyncio.to_thread(client.release, "w")
        assert await asyncio.to_thread(loads.lookup, "e", PROMPT) == 32
        assert await asyncio.to_thread(loads.load, "e", dst) == 32
        assert equal_slots(bufs, SRC, dst)
        assert (loads.loads, loads.fenced) == (1, 0)
        assert _locked(backend) == 0  # ended by the answered commit, before load returned


async def test_release_between_claim_and_commit_makes_the_load_a_miss(
        work: Path) -> None:
    async with solo(work) as e:
        client, backend = e.client, _backend(e.ra)
        assert await asyncio.to_thread(client.lookup, "c", PROMPT) == 32
        got = await asyncio.to_thread(client.claim_load, "c")
        assert got is not None and got["hit"] == 32 and len(got["blocks"]) == 8
        assert got["tier"]["kind"] == "memfd" and got["tier"]["id"] == _tier_id(e.ra)
        await asyncio.to_thread(client.release, "c")
        assert _locked(backend) == 0  # the release unpinned the blocks
        assert await asyncio.to_thread(client.commit_load, "c") is False
        with pytest.raises(EngineAPIError, match="claim_load first"):
            await asyncio.to_thread(client.commit_load, "c")  # answered once
        # A new lookup of the rid ends its claim the same way.
        assert await asyncio.to_thread(client.lookup, "c", PROMPT) == 32
        assert (await asyncio.to_thread(client.claim_load, "c")) is not None
        assert await asyncio.to_thread(client.lookup, "c", PROMPT) == 32
        assert await asyncio.to_thread(client.commit_load, "c") is False
        assert _locked(backend) == 8  # only the new lookup's pins
        # The rid starts clean afterwards: a claim of that lookup commits True.
        assert (await asyncio.to_thread(client.claim_load, "c")) is not None
        assert await asyncio.to_thread(client.commit_load, "c") is True
        assert _locked(backend) == 0


async def test_calls_out_of_order_are_refused_by_name(work: Path) -> None:
    async with solo(work) as e:
        client, loads = e.client, e.loads
        with pytest.raises(EngineAPIError, match=r"'never-claimed'.*claim_load first"):
            await asyncio.to_thread(client.commit_load, "never-claimed")
        with pytest.raises(EngineAPIError, match=r"'never-looked-up'.*call lookup first"):
            await asyncio.to_thread(client.claim_load, "never-looked-up")
        # Claimed once: a second claim of the same lookup is refused.
        assert await asyncio.to_thread(client.lookup, "twice", PROMPT) == 32
        assert await asyncio.to_thread(client.claim_load, "twice") is not None
        with pytest.raises(EngineAPIError, match=r"'twice'.*call lookup"):
            await asyncio.to_thread(client.claim_load, "twice")
        assert await asyncio.to_thread(client.commit_load, "twice") is True
        # A retrieve of a claimed lookup is refused too (the engine copies it).
        assert await asyncio.to_thread(client.lookup, "ret", PROMPT) == 32
        assert await asyncio.to_thread(client.claim_load, "ret") is not None
        with pytest.raises((EngineAPIError, ValueError)):
            await asyncio.to_thread(client.retrieve, "ret", np.arange(100, 132))
        await asyncio.to_thread(client.release, "ret")
        # A miss: nothing to claim, nothing to copy, nothing to commit.
        other = np.arange(7000, 7016, dtype=np.int64)
        assert await asyncio.to_thread(client.lookup, "m", other) == 0
        assert await asyncio.to_thread(client.claim_load, "m") == {
            "hit": 0, "blocks": [], "tier": {}, "claim": -1, "fence": None}
        assert await asyncio.to_thread(client.lookup, "m2", other) == 0
        assert await asyncio.to_thread(loads.load, "m2", np.zeros(0, dtype=np.int64)) == 0
        with pytest.raises(EngineAPIError, match="claim_load first"):
            await asyncio.to_thread(client.commit_load, "m2")
        assert _locked(_backend(e.ra)) == 0


async def test_a_bad_slot_mapping_ends_the_claim(work: Path) -> None:
    async with solo(work) as e:
        client, bufs, loads, backend = e.client, e.bufs, e.loads, _backend(e.ra)
        for bad in (np.arange(64, 80), np.arange(64, 97), np.r_[np.arange(64, 95), -1],
                    np.r_[np.arange(64, 95), NUM_SLOTS]):
            assert await asyncio.to_thread(client.lookup, "b", PROMPT) == 32
            with pytest.raises(ValueError, match="claim_load: slot_mapping"):
                await asyncio.to_thread(loads.load, "b", bad.astype(np.int64))
            assert _locked(backend) == 0  # the claim ended: nothing pinned
            with pytest.raises(EngineAPIError, match="claim_load first"):
                await asyncio.to_thread(client.commit_load, "b")
        # The same rid loads normally afterwards.
        dst = np.arange(64, 96, dtype=np.int64)
        zero_slots(bufs, dst)
        assert await asyncio.to_thread(client.lookup, "b", PROMPT) == 32
        assert await asyncio.to_thread(loads.load, "b", dst) == 32
        assert equal_slots(bufs, SRC, dst)


def _backend(ra: Any) -> EmbeddedBackend:
    """The embedded backend behind the agent's only stage."""
    [stage] = ra.agent.service.stages.values()
    backend = stage.coordinator._role.backend
    while not isinstance(backend, EmbeddedBackend):
        backend = backend.backend  # a shared stage's view
    return backend


def _locked(backend: EmbeddedBackend) -> int:
    index = backend._index
    assert index is not None
    return index.locked()


def tier_of(blocks: int) -> dict[str, Any]:
    """``tiers`` of an agent whose CPU tier holds ``blocks`` blocks of LAYOUT."""
    return {"cpu": {"size": blocks * LAYOUT.bytes_per_block, "pinned": False}}


async def test_a_lease_ending_during_a_paused_copy_makes_the_load_a_miss(
        work: Path) -> None:
    """The engine's copy pauses mid-way; the agent's claim lease (its transfer
    budget) ends meanwhile and another store rewrites the claimed blocks. The copy
    then completes, but the commit answers False and the load reports 0 tokens."""
    async with solo(work, tiers=tier_of(8)) as e:
        client, bufs, loads, backend = e.client, e.bufs, e.loads, _backend(e.ra)
        storer = EngineClient(e.socket, RANK, timeout=10)
        try:
            # A first load maps the tier (and builds the copier the hook goes on).
            dst = np.arange(64, 96, dtype=np.int64)
            assert await asyncio.to_thread(client.lookup, "warm", PROMPT) == 32
            assert await asyncio.to_thread(loads.load, "warm", dst) == 32
            copier = loads._copier
            assert copier is not None
            paused, resume = threading.Event(), threading.Event()
            calls = [0]

            def hook(abort: threading.Event | None) -> None:
                calls[0] += 1
                if calls[0] == 2:
                    paused.set()
                    assert resume.wait(60)

            copier.checkpoint_hook = hook
            zero_slots(bufs, dst)
            assert await asyncio.to_thread(client.lookup, "e", PROMPT) == 32
            load = asyncio.create_task(asyncio.to_thread(loads.load, "e", dst))
            try:
                await wait_for_async(paused.is_set, "the engine copy paused", 30)
                # The lease ends (nothing pinned any more) ...
                await wait_for_async(lambda: _locked(backend) == 0, "the claim's lease ended",
                                     60, interval=0.05)
                # ... and another prompt takes every block of the full tier.
                other = np.arange(8000, 8032, dtype=np.int64)
                await asyncio.to_thread(store_prompt, storer, bufs, "o", other,
                                        np.arange(160, 192, dtype=np.int64), 5)
                assert await asyncio.to_thread(storer.lookup, "gone", PROMPT) == 0
                await asyncio.to_thread(storer.release, "gone")
            finally:
                resume.set()
            assert await asyncio.wait_for(load, 60) == 0
            assert (loads.loads, loads.misses) == (1, 1)
            # What the copy left in the slots is not the stored KV: reporting it
            # loaded would have been wrong.
            assert not equal_slots(bufs, SRC, dst)
        finally:
            storer.close()


async def test_a_restarted_agent_refuses_the_old_tier_and_loads_map_the_new_one(
        work: Path) -> None:
    data = agent_mapping(work, "solo")
    agent = await asyncio.to_thread(launch_agent, work, "first", data)
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    client = EngineClient(data["engineSocket"], RANK, timeout=10)
    loads = EngineLoads(client, LAYOUT, bufs.tensors)
    try:
        await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)
        await asyncio.to_thread(store_prompt, client, bufs, "s")
        dst = np.arange(64, 96, dtype=np.int64)
        assert await asyncio.to_thread(client.lookup, "e", PROMPT) == 32
        assert await asyncio.to_thread(loads.load, "e", dst) == 32
        assert equal_slots(bufs, SRC, dst)
        tier = loads._tier
        assert tier is not None
        old = tier.tier_id
        tier_socket = data["engineSocket"] + ".tier"
        assert loads.tier_socket == tier_socket and os.path.exists(tier_socket)
        before = tier.tier.pool.clone()
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(30)
        # The engine's mapping keeps the dead agent's tier as it was.
        assert torch.equal(tier.tier.pool, before)

        data2 = {**data, "ports": {"http": free_port(), "fanout": free_port()}}
        agent = await asyncio.to_thread(launch_agent, work, "second", data2)
        assert os.path.exists(tier_socket)
        with pytest.raises(ValueError, match=f"refused tier {old}: no shared CPU tier {old}"):
            await asyncio.to_thread(receive_tier_fd, tier_socket, old)
        await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)
        await asyncio.to_thread(store_prompt, client, bufs, "s2", PROMPT, SRC, 3)
        zero_slots(bufs, dst)
        assert await asyncio.to_thread(client.lookup, "e2", PROMPT) == 32
        assert await asyncio.to_thread(loads.load, "e2", dst) == 32
        tier = loads._tier
        assert tier is not None and tier.tier_id != old
        assert equal_slots(bufs, SRC, dst)
        # The new tier's descriptor is handed out (the id the engine mapped).
        fd = await asyncio.to_thread(receive_tier_fd, tier_socket, tier.tier_id)
        os.close(fd)
    finally:
        loads.close()
        client.close()
        await asyncio.to_thread(stop_process, agent.proc)
        bufs.close()
    assert not os.path.exists(tier_socket)  # a clean stop removes the tier socket


def test_a_tensor_parallel_stage_hands_out_no_claims() -> None:
    """With two TP ranks every rank loads its own heads: the coordinator answers
    None and the lookup stays open for the retrieve, which loads it."""
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_size=4, kv_dim=2,
                      dtype=KVDtype.FLOAT32, tokens_per_block=4, tp_size=2)
    bcfg = EmbeddedBackendConfig(layout=layout, cpu_bytes=32 * layout.bytes_per_block,
                                 pinned=False, cpu_shared=True)
    ccfg = CoordinatorConfig(group=solo_view().view.group, pp_rank=0, layout=layout,
                             fanout_endpoint=None, engine_call_seconds=6.0,
                             fanout_wait_seconds=2.5, transfer_seconds=1.1, expected_ranks=2)
    conn = Coordinator(ccfg, solo_view(), backend_factory=lambda: EmbeddedBackend(bcfg),
                       store_factory=lambda: TierStore(bcfg), keys=None)
    conn.start()
    try:
        shape = (64, layout.heads_per_rank, layout.head_size)
        bufs = [[[torch.randn(shape) for _ in range(2)] for _ in range(2)] for _ in range(2)]
        for rank in range(2):
            conn.register_kv_buffers(rank, bufs[rank])
        wait_for(conn.ready, "both ranks registered", 30)
        prompt = np.arange(16, dtype=np.int64)
        assert conn.store_kv("s", prompt, torch.arange(16)) >= 0
        wait_for(lambda: "s" in conn.poll_completed(), "the store completed", 30)
        assert conn.lookup("l", prompt) == 16
        assert conn.claim_load("l") is None
        assert conn.retrieve("l", torch.arange(32, 48)) == 16
        for rank in range(2):
            for group in bufs[rank]:
                for t in group:
                    assert torch.equal(t[32:48], t[:16])
    finally:
        conn.close()


def test_a_pipeline_parallel_group_hands_out_no_claims() -> None:
    """Every stage of a PP group loads its own layers: neither the leader nor a
    follower hands a load out, and the lookup stays open for the retrieves, which
    load each stage's own KV."""
    with InProcessGroup(2) as pp:
        prompt = np.arange(300, 316, dtype=np.int64)
        pp.store_everywhere("s", prompt)
        assert pp.lookup_everywhere("l", prompt) == [16, 16]
        leader = pp.conns[0]._role
        assert isinstance(leader, LeaderRole)
        assert leader.claim_load("l") is None  # followers: before any backend call
        assert [pp.call(r, lambda c: c.claim_load("l")).result(30) for r in range(2)] \
            == [None, None]
        dst = np.arange(400, 416)
        got = [f.result(30) for f in [pp.retrieve(r, "l", dst) for r in range(2)]]
        assert got == [16, 16]
        assert all(pp.loaded_ok(r, prompt, dst, 16) for r in range(2))


async def test_loads_racing_evicting_stores_are_the_stored_kv_whenever_reported(
        work: Path) -> None:
    """Engine-copied loads of one prompt run while another client stores other
    prompts into a tier too small for all of them (evicting and rewriting blocks,
    the prompt among them, which is stored again when gone). Every load reported
    loaded holds the prompt's KV bit for bit; misses (evicted, lease over) may
    happen, wrong bytes may not."""
    async with solo(work, tiers=tier_of(12)) as e:
        client, bufs, loads = e.client, e.bufs, e.loads
        storer = EngineClient(e.socket, RANK, timeout=10)
        stop = threading.Event()
        stored = [0]

        def churn() -> None:
            rng = np.random.default_rng(1)
            i = 0
            while not stop.is_set():
                other = rng.integers(20_000, 40_000, 16, dtype=np.int64)
                store_prompt(storer, bufs, f"o{i}", other,
                             np.arange(160 + 16 * (i % 4), 176 + 16 * (i % 4), dtype=np.int64),
                             11 + i)
                stored[0] += 1
                i += 1

        def engine(rounds: int) -> int:
            loaded = 0
            dst = np.arange(64, 96, dtype=np.int64)
            for r in range(rounds):
                hit = client.lookup(f"e{r}", PROMPT)
                if hit < 32:
                    client.release(f"e{r}")
                    # Stored again from SRC, unchanged (best effort: -1 when there
                    # is no room right now, or a store of it is still in flight).
                    client.store_kv(f"re{r}", PROMPT, SRC)
                    client.release(f"re{r}")
                    continue
                zero_slots(bufs, dst)
                got = loads.load(f"e{r}", dst)
                assert got in (0, 32), got
                if got:
                    assert equal_slots(bufs, SRC, dst), f"round {r}: wrong KV reported loaded"
                    loaded += 1
                client.release(f"e{r}")
            return loaded

        try:
            bg = asyncio.create_task(asyncio.to_thread(churn))
            try:
                loaded = await asyncio.to_thread(engine, 150)
            finally:
                stop.set()
                await asyncio.wait_for(bg, 60)
            assert loaded > 0 and stored[0] > 0, (loaded, stored[0])
        finally:
            storer.close()

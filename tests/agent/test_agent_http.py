"""The agent's HTTP surface on a real uvicorn (loopback), queried with httpx:
health, readiness transitions, status, Prometheus metrics. Agents run in the test's
event loop; engine calls go through the client library over the real ipc socket
from worker threads."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.engine_api.service import INLINE_CANDIDATES
from node_agent.pp.auth import CurveKeys
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    TPB,
    agent_mapping,
    cfg_of,
    running_agent,
    wait_http,
    wait_stored,
    write_group_file,
)
from tests.observability.prometheus import require_binary
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(90)

CONTRACT_METRICS = [
    "flexkv_agent_lookup_tokens_total", "flexkv_agent_hit_tokens_total",
    "flexkv_agent_stored_tokens_total", "flexkv_agent_transfer_bytes_total",
    "flexkv_agent_transfer_seconds", "flexkv_agent_match_seconds",
    "flexkv_agent_tier_capacity_bytes", "flexkv_agent_tier_used_bytes",
    "flexkv_agent_evictions_total", "flexkv_agent_engine_requests_total",
    "flexkv_agent_engine_request_seconds", "flexkv_agent_fanout_lag_seconds",
    "flexkv_agent_fanout_dropped_total", "flexkv_agent_pp_role", "flexkv_agent_pp_epoch",
    "flexkv_agent_leader_changes_total", "flexkv_agent_ready",
    "flexkv_agent_fanout_mismatch_total", "flexkv_agent_pp_degraded",
]


def _fill(bufs: SharedKVBuffers, slots: np.ndarray, seed: int) -> None:
    for g, group in enumerate(bufs.tensors):
        for layer, t in enumerate(group):
            vals = np.arange(len(slots) * t[0].numel(), dtype=np.float32).reshape(
                len(slots), *t.shape[1:]) + 1000 * seed + 100 * g + 10 * layer
            t[slots] = __import__("torch").from_numpy(vals % 2000).to(t.dtype)


def _read(bufs: SharedKVBuffers, slots: np.ndarray) -> list[Any]:
    return [t[slots].clone() for group in bufs.tensors for t in group]


async def test_single_stage_agent_http_surface(work: Path) -> None:
    cfg = cfg_of(agent_mapping(work, "solo"))
    async with running_agent(cfg) as ra:
        health = await ra.get("/healthz")
        assert health.status_code == 200
        assert health.json() == {"alive": True, "components": {"engine_api": True}}
        not_ready = await ra.get("/readyz")
        assert not_ready.status_code == 503
        body = not_ready.json()
        assert body["ready"] is False
        assert body["components"]["ranks"] == {"ready": False, "registered": 0, "expected": 1}

        bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
        client = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"), timeout=5)
        try:
            registered = await asyncio.to_thread(client.register_kv_buffers, LAYOUT,
                                                 bufs.handles)
            # What it answers on the I/O thread, in arrival order (release_nowait).
            assert registered["inOrder"] == sorted(INLINE_CANDIDATES)
            ready = await wait_http(ra, "/readyz", 200, 10)
            assert all(c["ready"] for c in ready.json()["components"].values())

            tokens = np.arange(32, dtype=np.int64)
            src = np.arange(32, dtype=np.int64)
            _fill(bufs, src, seed=1)
            want = _read(bufs, src)
            assert await asyncio.to_thread(client.store_kv, "a", tokens, src) >= 0
            await wait_stored(client, "a")
            assert await asyncio.to_thread(client.lookup, "b", tokens) == 32
            dst = np.arange(100, 132, dtype=np.int64)
            assert await asyncio.to_thread(client.retrieve, "b", dst) == 32
            got = _read(bufs, dst)
            assert all(bool((w == g).all()) for w, g in zip(want, got, strict=True))
            with pytest.raises(ValueError, match="kv_indices"):
                await asyncio.to_thread(client.store_kv, "c", tokens,
                                        np.arange(10_000, 10_032))

            status = (await ra.get("/status")).json()
            assert status["pool"] == "tp" and status["node"] == "solo"
            assert status["tiers"]["cpu"]["capacityBytes"] > 0
            assert status["tiers"]["cpu"]["usedBytes"] >= 8 * LAYOUT.bytes_per_block
            [stage] = status["stages"]
            assert stage["replica"] == "solo-0" and stage["registeredRanks"] == [0]
            assert stage["connector"]["role"] == "leader"
            # A single-stage group's lookups, stores and releases wait on no
            # follower: the engine socket's I/O thread answers them without a
            # worker hop.
            [st] = ra.agent.service.stages.values()
            assert st.inline_ops == INLINE_CANDIDATES == {
                "lookup", "store_kv", "release", "poll_completed", "lookup_claim",
                "claim_load", "commit_load", "tier"}
            assert (stage["role"], stage["epoch"]) == ("leader", 0) and stage["seq"] >= 1
            assert any("kv_indices" in e["message"] for e in status["recentErrors"])

            text = (await ra.get("/metrics")).text
            for name in CONTRACT_METRICS:
                assert re.search(rf"^# TYPE {name} ", text, re.M), name
            assert 'flexkv_agent_engine_requests_total{op="store_kv",outcome="error"} 1.0' in text
            assert "flexkv_agent_ready 1.0" in text
            assert 'flexkv_agent_pp_degraded{group="tp-solo-0"} 0.0' in text, text
            _promtool(text, work)
        finally:
            client.close()
            bufs.close()


def _promtool(text: str, work: Path) -> None:
    exe = require_binary("promtool")  # fails in CI as root when missing, else skips
    out = subprocess.run([exe, "check", "metrics"], input=text, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


async def test_pp_group_readiness_follows_registration_and_peer_loss(work: Path) -> None:
    CurveKeys.generate().write(work / "curve")
    lead_map = agent_mapping(work, "node-0", groupViewFile=str(work / "groups.yaml"))
    foll_map = agent_mapping(work, "node-1", groupViewFile=str(work / "groups.yaml"))
    fanout = {0: lead_map["ports"]["fanout"], 1: foll_map["ports"]["fanout"]}
    write_group_file(work / "groups.yaml", "tp", "rep", fanout)
    lead_cfg, foll_cfg = cfg_of(lead_map), cfg_of(foll_map)
    bufs = [SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS) for _ in range(2)]
    clients = [EngineClient(c.engine_socket, RankInfo("rep", pp_rank=r, pp_size=2), timeout=5)
               for r, c in enumerate((lead_cfg, foll_cfg))]
    try:
        async with running_agent(lead_cfg) as lead:
            foll_cm = running_agent(foll_cfg)
            foll = await foll_cm.__aenter__()
            try:
                for r in (lead, foll):
                    body = (await wait_http(r, "/readyz", 503, 5)).json()
                    assert body["components"]["ranks"]["ready"] is False
                    assert body["components"]["group_view"]["known"] == ["rep"]
                for c, b in zip(clients, bufs, strict=True):
                    got = await asyncio.to_thread(c.register_kv_buffers, LAYOUT, b.handles)
                    assert got["inOrder"] == []  # nothing may be sent without waiting
                ready = await wait_http(lead, "/readyz", 200, 15)
                fan = ready.json()["components"]["fanout"]["stages"]["rep/pp0"]
                assert fan["role"] == "leader" and fan["peersConnected"] == 1
                assert (await wait_http(foll, "/readyz", 200, 15)).json()["ready"]
                status = (await lead.get("/status")).json()
                assert status["groups"]["rep"]["epoch"] == 1
                assert status["stages"][0]["connector"]["role"] == "leader"
                # Stages of a PP group wait on each other: every call takes a worker.
                for r in (lead, foll):
                    assert [s.inline_ops for s in r.agent.service.stages.values()] == [
                        frozenset()]
            finally:
                await foll_cm.__aexit__(None, None, None)
            # The follower is gone; the operator, seeing its Lease expire, marks the
            # member not ready in the group view: the leader is no longer ready.
            write_group_file(work / "groups.yaml", "tp", "rep", fanout, unready=(1,))
            lost = (await wait_http(lead, "/readyz", 503, 20)).json()
            assert lost["components"]["group_view"]["unreadyMembers"] == ["rep/pp1"]
            # It comes back on the same ports; its engine re-registers on the next call.
            async with running_agent(foll_cfg) as foll2:
                write_group_file(work / "groups.yaml", "tp", "rep", fanout)
                assert await asyncio.to_thread(clients[1].lookup, "x", np.arange(8)) == 0
                await wait_http(lead, "/readyz", 200, 20)
                await wait_http(foll2, "/readyz", 200, 20)
                regs = (await foll2.get("/status")).json()["stages"][0]["registrations"]
                assert regs == 1
    finally:
        for c in clients:
            c.close()
        for b in bufs:
            b.close()


async def test_cache_epoch_bump_in_config_file_flushes_the_cache(work: Path) -> None:
    data = agent_mapping(work, "solo")
    path = work / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = cfg_of(data)
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    client = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"), timeout=5)
    tokens = np.arange(16, dtype=np.int64)
    try:
        async with running_agent(cfg, config_path=path) as ra:
            await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)
            assert await asyncio.to_thread(client.store_kv, "a", tokens, np.arange(16)) >= 0
            await wait_stored(client, "a")
            assert await asyncio.to_thread(client.lookup, "b", tokens) == 16
            await asyncio.to_thread(client.release, "b")
            # While the reset holds the stage's locks, its calls take worker
            # threads instead of the engine socket's I/O thread.
            [stage] = ra.agent.service.stages.values()
            real_reset, seen = stage.coordinator.reset, []

            def watched_reset() -> None:
                seen.append(stage.inline_ops)
                real_reset()

            stage.coordinator.reset = watched_reset  # type: ignore[method-assign]
            path.write_text(yaml.safe_dump({**data, "cacheEpoch": 1}))
            async def epoch_applied() -> bool:
                return bool((await ra.get("/status")).json()["cacheEpoch"] == 1)

            await wait_for_async(epoch_applied, "cacheEpoch 1 applied", 10)
            assert seen == [frozenset()] and stage.inline_ops == INLINE_CANDIDATES
            assert await asyncio.to_thread(client.lookup, "c", tokens) == 0
    finally:
        client.close()
        bufs.close()


async def test_one_stage_per_agent_and_idle_stage_yields_to_new_replica(work: Path) -> None:
    cfg = cfg_of(agent_mapping(work, "solo", heartbeat={
        "leaseDurationSeconds": 1, "renewDeadlineSeconds": 0.5, "retryPeriodSeconds": 0.1}))
    bufs = [SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS) for _ in range(2)]
    first = EngineClient(cfg.engine_socket, RankInfo(replica="old-0"), timeout=5)
    second = EngineClient(cfg.engine_socket, RankInfo(replica="new-0"), timeout=5)
    try:
        async with running_agent(cfg) as ra:
            await asyncio.to_thread(first.register_kv_buffers, LAYOUT, bufs[0].handles)
            with pytest.raises(ValueError, match="already serves 1 stage"):
                await asyncio.to_thread(second.register_kv_buffers, LAYOUT, bufs[1].handles)
            await asyncio.sleep(1.3)  # no call from old-0 for longer than the lease duration
            await asyncio.to_thread(second.register_kv_buffers, LAYOUT, bufs[1].handles)
            stages = (await ra.get("/status")).json()["stages"]
            assert [s["replica"] for s in stages] == ["new-0"]
            assert await asyncio.to_thread(second.lookup, "x", np.arange(8)) == 0
    finally:
        for c in (first, second):
            c.close()
        for b in bufs:
            b.close()


async def test_tensor_parallel_ranks_register_and_rank0_moves_all(work: Path) -> None:
    import torch

    from node_agent.vocab.layout import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=4, head_size=8, dtype=LAYOUT.dtype,
                      tokens_per_block=LAYOUT.tokens_per_block, tp_size=2)
    cfg = cfg_of(agent_mapping(work, "solo", expectedRanks=2))
    bufs = [SharedKVBuffers.for_layout(layout, NUM_SLOTS) for _ in range(2)]
    clients = [EngineClient(cfg.engine_socket, RankInfo("tp-0", tp_rank=r, tp_size=2), timeout=5)
               for r in range(2)]
    try:
        async with running_agent(cfg) as ra:
            await asyncio.to_thread(clients[0].register_kv_buffers, layout, bufs[0].handles)
            body = (await wait_http(ra, "/readyz", 503, 5)).json()
            assert body["components"]["ranks"]["registered"] == 1
            await asyncio.to_thread(clients[1].register_kv_buffers, layout, bufs[1].handles)
            await wait_http(ra, "/readyz", 200, 10)
            tokens, src = np.arange(16, dtype=np.int64), np.arange(16, dtype=np.int64)
            for r, b in enumerate(bufs):
                for g, group in enumerate(b.tensors):
                    for layer, t in enumerate(group):
                        t[:16] = float(100 * r + 10 * g + layer)
            with pytest.raises(ValueError, match="only TP rank 0 calls"):
                await asyncio.to_thread(clients[1].store_kv, "a", tokens, src)
            assert await asyncio.to_thread(clients[0].store_kv, "a", tokens, src) >= 0
            await wait_stored(clients[0], "a")
            assert await asyncio.to_thread(clients[0].lookup, "b", tokens) == 16
            dst = np.arange(64, 80, dtype=np.int64)
            assert await asyncio.to_thread(clients[0].retrieve, "b", dst) == 16
            for r, b in enumerate(bufs):  # rank 1's KV came back too
                for g, group in enumerate(b.tensors):
                    for layer, t in enumerate(group):
                        want = torch.full_like(t[64:80], float(100 * r + 10 * g + layer))
                        assert torch.equal(t[64:80], want), (r, g, layer)
    finally:
        for c in clients:
            c.close()
        for b in bufs:
            b.close()


async def test_a_stage_with_an_ssd_tier_never_stores_on_the_io_thread(work: Path) -> None:
    """A store whose match evicts writes the evicted blocks to SSD on the calling
    thread; with an SSD tier ``store_kv`` therefore keeps the worker pool, and the
    engine socket's I/O thread never writes to disk."""
    block = LAYOUT.bytes_per_block
    data = agent_mapping(work, "solo", tiers={
        "cpu": {"size": block * 4, "pinned": False},  # a second prompt evicts the first
        "ssd": {"size": block * 32, "paths": [str(work / "ssd")]}})
    cfg = cfg_of(data)
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    client = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"), timeout=10)
    try:
        async with running_agent(cfg) as ra:
            await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)
            [stage] = ra.agent.service.stages.values()
            assert stage.inline_ops == INLINE_CANDIDATES - {"store_kv"}
            # The SSD tier writes a spill with one os.pwritev per run of blocks.
            writers: list[str] = []
            real_pwritev = os.pwritev

            def noted_pwritev(fd: int, buffers: Any, offset: int, *flags: int) -> int:
                writers.append(threading.current_thread().name)
                return real_pwritev(fd, buffers, offset, *flags)

            os.pwritev = noted_pwritev
            try:
                for i, rid in enumerate(("a", "b")):
                    tokens = np.arange(1000 * (i + 1), 1000 * (i + 1) + 4 * TPB,
                                       dtype=np.int64)
                    assert await asyncio.to_thread(client.store_kv, rid, tokens,
                                                   np.arange(4 * TPB)) >= 0
                    await wait_stored(client, rid)
            finally:
                os.pwritev = real_pwritev
            assert writers, "the second store evicted nothing to SSD"
            assert "engine-api-io" not in writers
    finally:
        client.close()
        bufs.close()

"""The engine's completion notification (``wait_completed``) through a real
agent and the real ipc socket: it returns as soon as a store is terminal with
the stored bytes loadable, returns ``[]`` when nothing finishes in time,
refuses a bad timeout with a named error, and the agent's ``ping`` (answered on
its I/O thread) keeps answering while a wait is in progress."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.engine_api import protocol
from tests.agent.harness import LAYOUT, NUM_SLOTS, agent_mapping, cfg_of, running_agent
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(90)


async def test_wait_completed_reports_a_store_and_times_out_empty(work: Path) -> None:
    cfg = cfg_of(agent_mapping(work, "solo"))
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    async with running_agent(cfg):
        client = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"), timeout=5)
        pinger = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"), timeout=5)
        try:
            await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)
            # Nothing stored yet: a short wait ends empty, and ping answers meanwhile.
            wait = asyncio.create_task(asyncio.to_thread(client.wait_completed, 0.5))
            assert (await asyncio.to_thread(pinger.ping))["version"] == protocol.VERSION
            assert await wait == []

            tokens = np.arange(5000, 5032, dtype=np.int64)
            src = np.arange(32, dtype=np.int64)
            planes = [t for g in bufs.tensors for t in g]
            for i, t in enumerate(planes):
                t[:32] = torch.arange(32, dtype=torch.float32).view(32, 1, 1).to(t.dtype) + i
            assert await asyncio.to_thread(client.store_kv, "w", tokens, src) >= 0
            done: list[str] = []
            for _ in range(20):
                done += await asyncio.to_thread(client.wait_completed, 2.0)
                if "w" in done:
                    break
            assert "w" in done
            # Reported means terminal: the bytes load back into other slots.
            assert await asyncio.to_thread(client.lookup, "r", tokens) == 32
            dst = np.arange(64, 96, dtype=np.int64)
            assert await asyncio.to_thread(client.retrieve, "r", dst) == 32
            for t in planes:
                assert torch.equal(t[64:96], t[:32])
            # A poll afterwards does not report the rid again.
            assert "w" not in await asyncio.to_thread(client.poll_completed)

            with pytest.raises(ValueError, match="timeout -1 must be >= 0"):
                client.wait_completed(-1)
            with pytest.raises(ValueError, match=r"timeoutMs 5000 is not in 0\.\.1000"):
                await asyncio.to_thread(
                    client._call, "wait_completed",
                    {"rank": RankInfo(replica="solo-0").to_wire(), "timeoutMs": 5000})
        finally:
            client.close()
            pinger.close()
    bufs.close()


async def test_a_single_stage_wait_is_parked_on_the_io_thread_and_woken_by_the_store(
        work: Path) -> None:
    """A single-stage group's ``wait_completed`` takes no worker thread while it
    waits (the I/O thread parks it) and is answered as soon as the store it
    waits for is terminal, long before its own timeout."""
    cfg = cfg_of(agent_mapping(work, "solo"))
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    async with running_agent(cfg) as ra:
        client = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"), timeout=5)
        waiter = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"), timeout=5)
        try:
            await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)
            engine = ra.agent.engine
            wait = asyncio.create_task(asyncio.to_thread(waiter.wait_completed, 10.0))
            await wait_for_async(lambda: engine.parked == 1, "the wait parked", 10)
            assert not wait.done()
            assert engine.inflight == 0  # no worker holds the wait
            tokens = np.arange(7000, 7032, dtype=np.int64)
            assert await asyncio.to_thread(client.store_kv, "p", tokens,
                                           np.arange(32, dtype=np.int64)) >= 0
            assert await asyncio.wait_for(wait, 30) == ["p"]
            assert await asyncio.to_thread(client.lookup, "q", tokens) == 32
        finally:
            client.close()
            waiter.close()
    bufs.close()

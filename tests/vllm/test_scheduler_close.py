"""The vLLM scheduler side's shutdown, without vLLM: a real agent on loopback, the
connector's scheduler half against it (vLLM-free: runs in the main venv).

vLLM shuts its workers down (freeing their KV caches) before the scheduler's
connector: a store or load still queued when ``SchedulerSide.close`` runs would
copy from or into memory the engine no longer owns, so none may be started."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.integrations.vllm.config import AgentConnectorConfig
from node_agent.integrations.vllm.scheduler_side import SchedulerSide, block_slots
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    TPB,
    agent_mapping,
    cfg_of,
    running_agent,
    short_dir,
    wait_http,
)
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(120)
REPLICA = "rep"


def _prompt(base: int) -> list[int]:
    return [int(t) for t in np.arange(base, base + 2 * TPB + 1)]  # 2 whole blocks + 1


@pytest.fixture()
def work() -> Iterator[Path]:
    d = short_dir("schedclose")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_close_starts_no_queued_store(work: Path) -> None:
    """A store queued behind one in flight when ``close`` runs is never made: its
    tokens are not cached afterwards, while the one in flight still completed."""
    cfg = cfg_of(agent_mapping(work, "solo"))
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    rank = RankInfo(REPLICA, pp_rank=0, pp_size=1)
    reg = EngineClient(cfg.engine_socket, rank, timeout=10)
    conn = AgentConnectorConfig(engine_socket=cfg.engine_socket, replica=REPLICA,
                                call_timeout_seconds=30.0, lookup_timeout_seconds=10.0,
                                retry_seconds=0.5)
    sched: SchedulerSide | None = None
    try:
        async with running_agent(cfg) as ra:
            await asyncio.to_thread(reg.register_kv_buffers, LAYOUT, bufs.handles)
            await wait_http(ra, "/readyz", 200, 30)
            slots = torch.as_tensor(block_slots([1, 2, 3, 4], TPB))
            for group in bufs.tensors:
                for t in group:
                    t[slots] = 3.0
            sched = SchedulerSide(conn, TPB, tp_size=1)
            # The store thread is held inside the first store's call until close ran.
            entered, gate = threading.Event(), threading.Event()
            real_store = sched._store_client.store_kv

            def held_store(rid: str, tokens: object, slots: object) -> int:
                if rid == "first":
                    entered.set()
                    assert gate.wait(60), "the test never opened the gate"
                return real_store(rid, tokens, slots)  # type: ignore[arg-type]

            sched._store_client.store_kv = held_store  # type: ignore[method-assign]
            first, queued = _prompt(100), _prompt(500)
            assert sched.finished("first", first, len(first) - 1, [1, 2]) is True
            assert await asyncio.to_thread(entered.wait, 60), "the first store never started"
            assert sched.finished("queued", queued, len(queued) - 1, [3, 4]) is True
            closing = asyncio.create_task(asyncio.to_thread(sched.close))
            await wait_for_async(lambda: None in list(sched._stores.queue),
                                 "close asked the store thread to stop", 30)
            gate.set()
            await closing
            assert not any(t.is_alive() for t in sched._threads), "a thread outlived close"
            probe = EngineClient(cfg.engine_socket, rank, timeout=10)
            try:
                def hit(rid: str, prompt: list[int]) -> int:
                    ids = np.asarray(prompt[:2 * TPB], dtype=np.int64)
                    found = probe.lookup(rid, ids)
                    probe.release(rid)
                    return int(found)

                # The store in flight at close still completes (its copy ends in the
                # agent); the queued one was never made, so it never can.
                async def first_cached() -> bool:
                    return await asyncio.to_thread(hit, "p1", first) == 2 * TPB

                await wait_for_async(first_cached, "the store in flight at close completed",
                                     30)
                assert await asyncio.to_thread(hit, "p2", queued) == 0, \
                    "a store queued when close ran was made after it"
            finally:
                probe.close()
    finally:
        if sched is not None:
            sched.close()
        reg.close()
        bufs.close()

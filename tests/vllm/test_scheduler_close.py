"""The vLLM scheduler side where the agent could touch blocks vLLM no longer gave
it, without vLLM: a real agent on loopback, the connector's scheduler half against
it (vLLM-free: runs in the main venv).

* Shutdown: vLLM shuts its workers down (freeing their KV caches) before the
  scheduler's connector, so a store or load still queued when
  ``SchedulerSide.close`` runs would copy from or into memory the engine no longer
  owns: none may be started.
* A load the agent could not stop (``SlotsInUse``): its blocks are never handed
  back to vLLM (neither recomputed into nor freed)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import node_agent.coordinator.leader as leader_mod
from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.coordinator.leader import LeaderRole
from node_agent.integrations.vllm.config import AgentConnectorConfig
from node_agent.integrations.vllm.scheduler_side import SchedulerSide, block_slots
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    TPB,
    RunningAgent,
    agent_mapping,
    cfg_of,
    running_agent,
    short_dir,
    wait_http,
)
from tests.coordinator.test_stuck_load import hang_loads
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


@contextlib.asynccontextmanager
async def solo_agent(work: Path, **extra: Any,
                     ) -> AsyncIterator[tuple[RunningAgent, SharedKVBuffers, SchedulerSide]]:
    """A one-stage agent with this engine's buffers registered, and the scheduler
    side connected to it (closed on exit, before the agent stops)."""
    cfg = cfg_of(agent_mapping(work, "solo", **extra))
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    reg = EngineClient(cfg.engine_socket, RankInfo(REPLICA, pp_rank=0, pp_size=1), timeout=10)
    conn = AgentConnectorConfig(engine_socket=cfg.engine_socket, replica=REPLICA,
                                call_timeout_seconds=30.0, lookup_timeout_seconds=10.0,
                                retry_seconds=0.5)
    try:
        async with running_agent(cfg) as ra:
            await asyncio.to_thread(reg.register_kv_buffers, LAYOUT, bufs.handles)
            await wait_http(ra, "/readyz", 200, 30)
            sched = SchedulerSide(conn, TPB, tp_size=1)
            try:
                yield ra, bufs, sched
            finally:
                await asyncio.to_thread(sched.close)
    finally:
        reg.close()
        bufs.close()


async def test_close_starts_no_queued_store(work: Path) -> None:
    """A store queued behind one in flight when ``close`` runs is never made: its
    tokens are not cached afterwards, while the one in flight still completed."""
    async with solo_agent(work) as (ra, bufs, sched):
        slots = torch.as_tensor(block_slots([1, 2, 3, 4], TPB))
        for group in bufs.tensors:
            for t in group:
                t[slots] = 3.0
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
        probe = EngineClient(str(ra.agent.cfg.engine_socket),
                             RankInfo(REPLICA, pp_rank=0, pp_size=1), timeout=10)
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

            await wait_for_async(first_cached, "the store in flight at close completed", 30)
            assert await asyncio.to_thread(hit, "p2", queued) == 0, \
                "a store queued when close ran was made after it"
        finally:
            probe.close()


async def test_a_load_the_agent_could_not_stop_never_gives_its_blocks_back(
        work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent answers ``SlotsInUse`` (its load copy ignores its abort, like a hung
    device): the blocks are not sent back for recompute, the load is never reported
    finished, and when the request ends its blocks stay held."""
    monkeypatch.setattr(leader_mod, "STOP_WAIT_SECONDS", 0.05)
    timeouts = {"engineCallSeconds": 2, "fanoutWaitSeconds": 1}
    async with solo_agent(work, timeouts=timeouts) as (ra, _, sched):
        prompt = _prompt(100)
        assert sched.finished("src", prompt, len(prompt) - 1, [1, 2]) is True
        sent: set[str] = set()

        def stored() -> bool:
            sent.update(sched.completions(set())[1])
            return "src" in sent

        await wait_for_async(stored, "the source store completed", 30)
        assert sched.lookup("dst", prompt, 0) == 2 * TPB
        [stage] = ra.agent.service.stages.values()
        role = stage.coordinator._role
        assert isinstance(role, LeaderRole)
        started, release = hang_loads(role.backend._store)  # type: ignore[attr-defined]
        try:
            sched.after_alloc("dst", [5, 6], 2 * TPB)
            await wait_for_async(lambda: sched.take_counters()["load_failures"] == 1,
                                 "the load answered", 30)
        finally:
            release.set()  # the hung copy ends before the agent stops
        assert started.is_set()
        report = sched.step_report()
        assert "dst" not in report.failed, "blocks the agent may still write were sent " \
            "back to vLLM for recompute"
        recv, _ = sched.completions(set())
        assert "dst" not in recv, "a load the agent could not stop was reported finished"
        assert sched.finished("dst", prompt, 0, [5, 6]) is True, \
            "vLLM would free blocks the agent may still write"
        assert "dst" not in sched.completions(set())[1]

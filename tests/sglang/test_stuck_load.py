"""An SGLang rank whose agent cannot stop a load copy (it ignores its abort, like a
hung device): ``retrieve_kv`` answers ``SLOTS_IN_USE``, not 0, so the radix cache
never frees slots the agent may still write. A real agent served in this event
loop on loopback (its leader backend's load copy held by the test)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import node_agent.coordinator.leader as leader_mod
from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.coordinator.leader import LeaderRole
from node_agent.integrations.sglang.connector import SLOTS_IN_USE, AgentKVConnector
from tests.agent.harness import LAYOUT, agent_mapping, cfg_of, running_agent, short_dir
from tests.coordinator.test_stuck_load import hang_loads
from tests.sglang.stage import Handle
from tests.support.clock import ManualClock
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def work() -> Iterator[Path]:
    d = short_dir("sgstuck")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_a_load_the_agent_could_not_stop_answers_slots_in_use(
        work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leader_mod, "STOP_WAIT_SECONDS", 0.05)
    cfg = cfg_of(agent_mapping(work, "solo", timeouts={"engineCallSeconds": 2,
                                                        "fanoutWaitSeconds": 1}))
    bufs = SharedKVBuffers.for_layout(LAYOUT, 128)
    client = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"), timeout=10)
    conn = AgentKVConnector(client, LAYOUT, bufs.handles, page_size=LAYOUT.tokens_per_block,
                            retry_seconds=5, clock=ManualClock())
    tokens = np.arange(500, 516, dtype=np.int64)
    src, dst = Handle("s", 0), Handle("d", 0)
    try:
        async with running_agent(cfg) as ra:
            assert await asyncio.to_thread(conn.connect) is True
            assert await asyncio.to_thread(conn.store_kv, src, tokens.tolist(),
                                           torch.arange(16)) >= 0
            done: list[object] = []

            def stored() -> bool:
                done.extend(conn.check_completed_stores())
                return src in done

            await wait_for_async(stored, "the source store completed", 30)
            task, hit = await asyncio.to_thread(conn.lookup_kv, tokens, None, dst)
            assert task >= 0 and hit == 16
            [stage] = ra.agent.service.stages.values()
            role = stage.coordinator._role
            assert isinstance(role, LeaderRole)
            started, release = hang_loads(role.backend._store)  # type: ignore[attr-defined]
            try:
                got = await asyncio.to_thread(conn.retrieve_kv, dst, torch.arange(64, 80))
            finally:
                release.set()  # the hung copy ends before the agent stops
            assert started.is_set()
            assert got == SLOTS_IN_USE, f"retrieve_kv answered {got}: the slots would be freed"
            assert conn.connected is True  # an answer about one call, not an agent outage
    finally:
        conn.shutdown()
        bufs.close()

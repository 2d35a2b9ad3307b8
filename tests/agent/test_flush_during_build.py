"""A cache-epoch flush that lands while a stage is being built reaches that stage
when it joins the agent: it serves under the new epoch, nothing of the old one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from node_agent.agent import Agent
from node_agent.assembly import StageDeps, default_stage_builder
from node_agent.client import SharedKVBuffers
from node_agent.engine_api.protocol import layout_to_wire
from node_agent.engine_api.service import RankRef, Stage
from node_agent.pp.auth import CurveKeys
from node_agent.vocab.layout import KVLayout
from tests.agent.harness import LAYOUT, NUM_SLOTS, agent_mapping, cfg_of

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def work(work: Path) -> Path:
    """The test's work directory with the agents' CURVE keys in ``curve``."""
    CurveKeys.generate().write(work / "curve")
    return work


def test_a_flush_during_a_stage_build_is_applied_when_the_stage_joins(work: Path) -> None:
    agents: list[Agent] = []

    def builder(deps: StageDeps, rank: RankRef, layout: KVLayout) -> Stage:
        stage = default_stage_builder(deps, rank, layout)
        agents[0].flush(1)  # the epoch watcher's flush, before the stage joins
        return stage

    agent = Agent(cfg_of(agent_mapping(work, "node-0")), builder)
    agents.append(agent)
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    try:
        rank = RankRef("rep", 0, 1, 0, 1)
        agent.service.register(rank, layout_to_wire(LAYOUT), bufs.handles)
        assert agent.cache_epoch == 1
        (stage,) = agent.service.stages.values()
        conn: Any = stage.coordinator
        tokens = np.arange(4 * LAYOUT.tokens_per_block, dtype=np.int64)
        assert conn.store_kv("r1", tokens, np.arange(tokens.size, dtype=np.int64)) >= 0
        done: list[str] = []
        for _ in range(100):  # bounded: each wait ends after 0.1 s
            done += conn.wait_completed(0.1)
            if "r1" in done:
                break
        assert "r1" in done
        # Served under the new epoch: the store is visible and a lookup hits it.
        assert conn.lookup("r2", tokens) == tokens.size
        assert conn.status()["cacheEpochRefused"] == {}
    finally:
        agent.service.close()
        bufs.close()

"""The tiers /status and the Lease report are the agent's own backends' stats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.agent import Agent
from node_agent.assembly import default_stage_builder
from node_agent.engine_api.service import RankRef
from node_agent.metrics import AgentMetrics
from node_agent.pp.auth import CurveKeys
from tests.agent.harness import LAYOUT, NUM_SLOTS, agent_mapping, cfg_of

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def work(work: Path) -> Path:
    """The test's work directory with the agents' CURVE keys in ``curve``."""
    CurveKeys.generate().write(work / "curve")
    return work


def _store(agent: Agent, blocks: int) -> dict[str, int]:
    """Build the agent's one stage, register a rank and store ``blocks`` blocks;
    returns the leader backend's own CPU tier stats."""
    stage = agent._build_stage(RankRef("rep", 0, 1, 0, 1), LAYOUT)
    agent.service.stages[stage.key] = stage
    shape = (NUM_SLOTS, LAYOUT.num_kv_heads, LAYOUT.head_size)
    k = [torch.ones(shape, dtype=torch.float16) for _ in range(LAYOUT.num_layers)]
    v = [torch.ones(shape, dtype=torch.float16) for _ in range(LAYOUT.num_layers)]
    stage.coordinator.register_kv_buffers(0, (k, v))
    tokens = np.arange(blocks * LAYOUT.tokens_per_block, dtype=np.int64)
    assert stage.coordinator.store_kv("r1", tokens, np.arange(tokens.size, dtype=np.int64)) >= 0
    done: list[str] = []
    for _ in range(100):  # bounded: each wait ends after 0.1 s
        done += stage.coordinator.wait_completed(0.1)
        if "r1" in done:
            break
    assert "r1" in done
    cpu = stage.coordinator.status()["tiers"]["cpu"]
    return {"capacityBytes": cpu["capacity_bytes"], "usedBytes": cpu["used_bytes"]}


def test_status_and_lease_tiers_are_this_agents_own_even_with_shared_metrics(
        work: Path) -> None:
    metrics = AgentMetrics()
    busy = Agent(cfg_of(agent_mapping(work, "node-0")), default_stage_builder, metrics=metrics)
    idle_mapping = agent_mapping(work, "node-1",
                                 tiers={"cpu": {"size": "2Mi", "pinned": False}})
    idle = Agent(cfg_of(idle_mapping), default_stage_builder, metrics=metrics)
    try:
        own = _store(busy, blocks=3)
        assert own["usedBytes"] == 3 * LAYOUT.bytes_per_block
        assert busy.status()["tiers"] == {"cpu": own}
        assert busy._heartbeat_info()["tiers"] == {"cpu": own}
        # The other agent has no stage: its configured size, nothing used, whatever
        # the metrics registry it shares last heard from another backend.
        configured = {"cpu": {"capacityBytes": 2 * 2**20, "usedBytes": 0}}
        assert idle.status()["tiers"] == configured
        assert idle._heartbeat_info()["tiers"] == configured
    finally:
        busy.service.close()
        idle.service.close()

"""A client whose timeout is not above the agent's call bound is told so at
registration: it could give up on a load whose copy still writes its slots."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from tests.agent.harness import LAYOUT, NUM_SLOTS, agent_mapping, cfg_of, running_agent

ENGINE_CALL = 4.0


@pytest.mark.parametrize(("client_timeout", "warned"), [(4.0, True), (4.4, True), (4.5, False)])
async def test_registration_names_the_agents_call_bound_and_warns_a_shorter_client(
        work: Path, caplog: pytest.LogCaptureFixture, client_timeout: float,
        warned: bool) -> None:
    cfg = cfg_of(agent_mapping(work, "solo", timeouts={"engineCallSeconds": ENGINE_CALL,
                                                       "fanoutWaitSeconds": 1}))
    bound = ENGINE_CALL + 0.4  # engineCallSeconds plus a tenth of it (vocab/budget.py)
    async with running_agent(cfg):
        bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
        client = EngineClient(cfg.engine_socket, RankInfo(replica="solo-0"),
                              timeout=client_timeout)
        try:
            with caplog.at_level(logging.WARNING, logger="node_agent.client"):
                reply = await asyncio.to_thread(client.register_kv_buffers, LAYOUT,
                                                bufs.handles)
        finally:
            client.close()
            bufs.close()
    assert reply["callSeconds"] == pytest.approx(bound)
    warnings = [r for r in caplog.records if r.name == "node_agent.client"
                and "not above the agent's call bound" in r.getMessage()]
    assert bool(warnings) is warned
    if warned:
        assert warnings[0].__dict__["agent_call_seconds"] == pytest.approx(bound)
        assert warnings[0].__dict__["client_timeout_seconds"] == client_timeout

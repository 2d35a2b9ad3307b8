"""An SGLang rank whose agent starts after it, serves, stops and restarts: the
connector degrades to misses while the agent is absent, registers when it comes
(after ``retry_seconds``), and never leaves a store's radix node locked when the
agent goes away (its socket file is removed on a clean stop)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.integrations.sglang.connector import AgentKVConnector
from tests.agent.harness import (
    LAYOUT,
    agent_mapping,
    agent_process,
    short_dir,
    start_agent_process,
    stop_process,
    wait_healthy,
)
from tests.sglang.stage import Handle
from tests.support.clock import ManualClock
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]




@pytest.fixture()
def work() -> Iterator[Path]:
    d = short_dir("sgla")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _completed(conn: AgentKVConnector, within: float = 20.0) -> list[object]:
    """The stores reported until none is in flight."""
    done: list[object] = []

    def drained() -> bool:
        done.extend(conn.check_completed_stores())
        return conn.stores_in_flight() == 0

    wait_for(drained, "every store reported", within, interval=0.02)
    return done


def test_agent_absent_then_present_then_gone_then_back(work: Path) -> None:
    data = agent_mapping(work, "solo")
    path = work / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    url = f"http://127.0.0.1:{data['ports']['http']}"
    bufs = SharedKVBuffers.for_layout(LAYOUT, 128)
    clock = ManualClock()
    client = EngineClient(str(data["engineSocket"]), RankInfo(replica="solo-0"), timeout=10)
    conn = AgentKVConnector(client, LAYOUT, bufs.handles, page_size=LAYOUT.tokens_per_block,
                            retry_seconds=5, clock=clock)
    tokens = np.arange(500, 516, dtype=np.int64)
    h1, h2, h3 = (Handle(r, 0) for r in ("s1", "s2", "s3"))
    agent = None
    try:
        assert conn.connect() is False  # no agent yet: SGLang serves on its own
        agent = start_agent_process(path, work / "agent.log")
        wait_healthy(url, agent)
        assert conn.lookup_kv(tokens, None, h1) == (-1, 0)
        assert conn.connected is False  # still inside retry_seconds: not even tried
        clock.now += 5
        assert conn.lookup_kv(tokens, None, h1) == (-1, 0)  # registered, a plain miss
        assert conn.connected is True

        planes = [t for g in bufs.tensors for t in g]
        for p, t in enumerate(planes):
            t.view(t.shape[0], -1)[:16] = float(p + 1)
        assert conn.store_kv(h1, tokens.tolist(), torch.arange(16)) >= 0
        assert _completed(conn) == [h1]
        task, hit = conn.lookup_kv(tokens, None, h2)
        assert task >= 0 and hit == 16
        assert conn.retrieve_kv(h2, torch.arange(64, 80)) == 16
        for p, t in enumerate(planes):
            assert torch.all(t.view(t.shape[0], -1)[64:80] == float(p + 1)), p

        # A store in flight when the agent stops: the socket file goes with the
        # agent, so the radix node is unlocked rather than held for ever.
        more = np.arange(600, 632, dtype=np.int64)
        assert conn.store_kv(h3, more.tolist(), torch.arange(16, 48)) >= 0
        assert stop_process(agent) == 0
        assert _completed(conn) == [h3]
        assert conn.stores_in_flight() == 0
        assert conn.lookup_kv(tokens, None, h2) == (-1, 0)
        assert conn.connected is False

        agent = start_agent_process(path, work / "agent.log")
        wait_healthy(url, agent)
        clock.now += 5
        assert conn.lookup_kv(tokens, None, h2) == (-1, 0)  # a new agent: empty cache
        assert conn.connected is True
    finally:
        conn.shutdown()
        if agent is not None:
            stop_process(agent)
        bufs.close()


def test_a_layout_the_agent_refuses_fails_start_up_then_only_logs(work: Path) -> None:
    """--page-size other than the pool's tokensPerBlock: the factory's connect()
    raises the agent's ValueError (SGLang does not start misconfigured); if the
    agent refuses later (a restarted agent with another configuration), calls
    degrade to misses instead of failing the scheduler."""
    from node_agent.vocab.layout import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype=LAYOUT.dtype,
                      tokens_per_block=2 * LAYOUT.tokens_per_block)
    bufs = SharedKVBuffers.for_layout(layout, 64)
    clock = ManualClock()
    with agent_process(work) as agent:
        client = EngineClient(agent.socket, RankInfo(replica="solo-0"), timeout=10)
        conn = AgentKVConnector(client, layout, bufs.handles, page_size=layout.tokens_per_block,
                                retry_seconds=5, clock=clock)
        try:
            with pytest.raises(ValueError, match="tokensPerBlock 8 differs from the pool's"):
                conn.connect()
            clock.now += 5
            assert conn.lookup_kv(list(range(16)), None, Handle("x", 0)) == (-1, 0)
            assert conn.store_kv(Handle("x", 0), list(range(16)), torch.arange(16)) == -1
            assert conn.connected is False
        finally:
            conn.shutdown()
            bufs.close()

"""Two real agent processes (`python -m node_agent run`) standing for two nodes, each
with its own CPU tier, sharing one pool through a real mooncake_master: a prompt
stored through agent A is served by agent B from the remote tier, bit-exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.demo.workload import kv_values
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    agent_mapping,
    short_dir,
    start_agent_process,
    stop_process,
    wait_healthy,
)
from tests.remote.master import Master, store_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
RANK = RankInfo(replica="eng-0")
TOKENS = np.arange(7000, 7064, dtype=np.int64)  # 16 blocks of 4 tokens
SRC = np.arange(64, dtype=np.int64)
DST = np.arange(128, 192, dtype=np.int64)


@pytest.fixture
def work() -> Iterator[Path]:
    d = short_dir("remote")
    yield d


def agent_config(work: Path, node: str, master: Master) -> tuple[Path, str]:
    data = agent_mapping(work, node, tiers={
        "cpu": {"size": "1Mi", "pinned": False},
        "remote": {"timeoutSeconds": 2, "queueBlocks": 256, "mooncake": {
            "masterAddress": master.address, "metadataServer": master.metadata,
            "segmentSize": "16Mi", "localBufferSize": "1Mi", "storePort": store_port()}},
    })
    path = work / f"{node}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, f"http://127.0.0.1:{data['ports']['http']}"


def remote_status(url: str) -> dict[str, object]:
    status: dict[str, object] = httpx.get(url + "/status", timeout=5).json()["remoteTier"]
    return status


def write_prompt(bufs: SharedKVBuffers, tokens: np.ndarray, slots: np.ndarray) -> None:
    planes = [t for g in bufs.tensors for t in g]
    for p, t in enumerate(planes):
        values = kv_values(tokens, 0, p, t.dtype).view(-1, 1)
        t.view(t.shape[0], -1)[torch.from_numpy(slots)] = values


def holds_prompt(bufs: SharedKVBuffers, tokens: np.ndarray, slots: np.ndarray) -> bool:
    planes = [t for g in bufs.tensors for t in g]
    for p, t in enumerate(planes):
        want = kv_values(tokens, 0, p, t.dtype).view(-1, 1).expand(-1, t[0].numel())
        if not torch.equal(t.view(t.shape[0], -1)[torch.from_numpy(slots)], want):
            return False
    return True


def test_agent_b_serves_agent_a_prefix_from_the_remote_tier(work: Path, master: Master) -> None:
    path_a, url_a = agent_config(work, "node-a", master)
    path_b, url_b = agent_config(work, "node-b", master)
    sock_a = str(yaml.safe_load(path_a.read_text())["engineSocket"])
    sock_b = str(yaml.safe_load(path_b.read_text())["engineSocket"])
    agent_a = start_agent_process(path_a, work / "a.log")
    agent_b = start_agent_process(path_b, work / "b.log")
    bufs_a = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    bufs_b = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    try:
        wait_healthy(url_a, agent_a)
        wait_healthy(url_b, agent_b)
        for url in (url_a, url_b):
            wait_for(lambda url=url: remote_status(url)["up"] is True,
                     f"{url} joined", 60, interval=0.1)
        ready = httpx.get(url_b + "/readyz", timeout=5).json()
        assert ready["components"]["remote"]["degraded"] is False

        client_a = EngineClient(sock_a, RANK, timeout=10)
        client_a.register_kv_buffers(LAYOUT, bufs_a.handles)
        write_prompt(bufs_a, TOKENS, SRC)
        assert client_a.store_kv("p", TOKENS, SRC) >= 0
        wait_for(lambda: "p" in client_a.poll_completed(), "store completed", 30, interval=0.1)
        client_a.release("p")
        block = LAYOUT.bytes_per_block
        wait_for(lambda: remote_status(url_a)["bytesPut"] == 16 * block
                 and remote_status(url_a)["queueDepth"] == 0,
                 "A wrote 16 blocks", 60, interval=0.1)

        client_b = EngineClient(sock_b, RANK, timeout=10)
        client_b.register_kv_buffers(LAYOUT, bufs_b.handles)
        assert client_b.lookup("q", TOKENS) == len(TOKENS)
        assert client_b.retrieve("q", DST) == len(TOKENS)
        client_b.release("q")
        assert holds_prompt(bufs_b, TOKENS, DST)
        status_b = remote_status(url_b)
        assert status_b["hitBlocks"] == 16 and status_b["bytesGet"] == 16 * block
        metrics = httpx.get(url_b + "/metrics", timeout=5).text
        assert "flexkv_agent_remote_hit_blocks_total 16.0" in metrics
        assert "flexkv_agent_remote_up 1.0" in metrics

        # The master goes away: B answers a miss for a new prompt inside the call's
        # budget, reports the remote component degraded, and stays ready.
        master.kill()
        other = TOKENS + 1000
        assert client_b.lookup("r", other) == 0
        assert client_b.retrieve("r", DST) == 0
        client_b.release("r")
        assert client_b.lookup("s", TOKENS) == len(TOKENS)  # local tiers keep serving
        client_b.release("s")
        wait_for(lambda: remote_status(url_b)["up"] is False,
                 "B saw the master down", 30, interval=0.1)
        r = httpx.get(url_b + "/readyz", timeout=5)
        assert r.status_code == 200
        assert r.json()["components"]["remote"]["degraded"] is True
        client_a.close()
        client_b.close()
    finally:
        stop_process(agent_a)
        stop_process(agent_b)
        bufs_a.close()
        bufs_b.close()


def test_a_retrieve_whose_lookup_straddles_a_cache_epoch_flush_answers_a_miss(
        work: Path, master: Master) -> None:
    """A lookup hits, the agent applies a ``cacheEpoch`` bump (every stage reset),
    then the engine retrieves: the retrieve answers 0 (a miss) and loads nothing,
    instead of failing for an unknown request id."""
    path, url = agent_config(work, "node-a", master)
    data = yaml.safe_load(path.read_text())
    agent = start_agent_process(path, work / "a.log")
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    try:
        wait_healthy(url, agent)
        client = EngineClient(str(data["engineSocket"]), RANK, timeout=10)
        client.register_kv_buffers(LAYOUT, bufs.handles)
        write_prompt(bufs, TOKENS, SRC)
        assert client.store_kv("p", TOKENS, SRC) >= 0
        wait_for(lambda: "p" in client.poll_completed(), "store completed", 30, interval=0.1)
        client.release("p")
        assert client.lookup("q", TOKENS) == len(TOKENS)

        path.write_text(yaml.safe_dump({**data, "cacheEpoch": 1}))
        wait_for(lambda: httpx.get(url + "/status", timeout=5).json()["cacheEpoch"] == 1,
                 "the epoch flush applied", 60, interval=0.1)
        assert client.retrieve("q", DST) == 0
        assert not holds_prompt(bufs, TOKENS, DST)
        client.release("q")
        # The rid starts clean afterwards: the flushed prefix is a miss, answered once.
        assert client.lookup("q", TOKENS) == 0
        assert client.retrieve("q", DST) == 0
        client.release("q")
        client.close()
    finally:
        stop_process(agent)
        bufs.close()

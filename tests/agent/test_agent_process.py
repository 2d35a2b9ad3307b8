"""The agent as a real process (``python -m node_agent run``) with engines in other
processes: engine restart keeps the cache, garbage on the engine socket, SIGTERM
shutdown, agent restart with transparent re-registration, CLI config errors, and
the demo end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml
import zmq

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.demo.workload import kv_values
from node_agent.engine_api import protocol
from node_agent.engine_api.protocol import layout_to_wire
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    agent_mapping,
    start_agent_process,
    stop_process,
    wait_healthy,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
RANK = RankInfo(replica="eng-0")
TOKENS = np.arange(1000, 1064, dtype=np.int64)  # 16 blocks of 4 tokens

# A first engine process: registers shared buffers, writes deterministic KV into
# slots 0..63, stores it, waits for completion, then exits (freeing its memory).
FIRST_ENGINE = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
    from node_agent.demo.workload import kv_values
    from node_agent.engine_api.protocol import parse_layout
    sock, layout_json, tokens_json, slots = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    layout = parse_layout(json.loads(layout_json))
    tokens = np.asarray(json.loads(tokens_json), dtype=np.int64)
    bufs = SharedKVBuffers.for_layout(layout, slots)
    client = EngineClient(sock, RankInfo(replica="eng-0"), timeout=10)
    client.register_kv_buffers(layout, bufs.handles)
    src = np.arange(len(tokens), dtype=np.int64)
    planes = [t for g in bufs.tensors for t in g]
    for p, t in enumerate(planes):
        t.view(t.shape[0], -1)[src] = kv_values(tokens, 0, p, t.dtype).view(-1, 1)
    assert client.store_kv("first", tokens, src) >= 0
    deadline = time.monotonic() + 10
    while "first" not in client.poll_completed():
        assert time.monotonic() < deadline, "store did not complete"
        time.sleep(0.01)
    client.release("first")
    client.close()
    bufs.close()
    print("stored", flush=True)
""")


def _config(work: Path) -> tuple[Path, dict[str, object]]:
    data = agent_mapping(work, "solo")
    path = work / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, data


def _exchange(sock: zmq.Socket[bytes], frames: list[bytes]) -> dict[str, object]:
    sock.send_multipart(frames)
    assert sock.poll(10_000), "the agent did not answer"
    reply: dict[str, object] = json.loads(sock.recv_multipart()[0])
    return reply


def test_agent_process_lifecycle(work: Path) -> None:
    path, data = _config(work)
    sock_path = str(data["engineSocket"])
    url = f"http://127.0.0.1:{data['ports']['http']}"  # type: ignore[index]
    log = work / "agent.log"
    agent = start_agent_process(path, log)
    bufs = None
    try:
        wait_healthy(url, agent)

        # 1. An engine process stores, then exits: an engine restart.
        first = subprocess.run(
            [sys.executable, "-c", FIRST_ENGINE, sock_path, json.dumps(layout_to_wire(LAYOUT)),
             json.dumps(TOKENS.tolist()), str(NUM_SLOTS)],
            capture_output=True, text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        assert first.stdout.strip() == "stored"

        # 2. The restarted engine (this process) registers new buffers: blocks are cached.
        bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
        client = EngineClient(sock_path, RANK, timeout=10)
        client.register_kv_buffers(LAYOUT, bufs.handles)
        assert client.lookup("again", TOKENS) == len(TOKENS)
        dst = np.arange(128, 128 + len(TOKENS), dtype=np.int64)
        assert client.retrieve("again", dst) == len(TOKENS)
        planes = [t for g in bufs.tensors for t in g]
        for p, t in enumerate(planes):
            want = kv_values(TOKENS, 0, p, t.dtype).view(-1, 1).expand(-1, t[0].numel())
            assert torch.equal(t.view(t.shape[0], -1)[torch.from_numpy(dst)], want), p
        client.release("again")
        status = httpx.get(url + "/status", timeout=5).json()
        assert status["stages"][0]["registrations"] == 2

        # 3. Garbage on the engine socket: error replies, the agent keeps serving.
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"ipc://{sock_path}")
        try:
            rng = np.random.default_rng(7)
            replies = [
                _exchange(raw, [rng.bytes(256)]),
                _exchange(raw, [b'{"v": 1, "id": 5, "op": "store_kv", "args": {"rid": 1}}']),
                _exchange(raw, [b'{"v": 1, "id": 6, "op": "lookup", "args": '
                                b'{"rid": "x", "rank": {"replica": "eng-0"}}, "arrays": '
                                b'{"token_ids": {"frame": 1, "dtype": "int64", "len": 9}}}',
                                b"\0" * 8]),
                _exchange(raw, [b" " * (protocol.MAX_HEADER_BYTES + 10)]),
                _exchange(raw, [b'{"v": 1, "id": 8, "op": "shutdown"}']),
                _exchange(raw, protocol.encode_request(
                    9, "lookup", {"rid": "x", "rank": {"replica": "nobody"}}, {"token_ids": [1]})),
            ]
            assert all(r["ok"] is False for r in replies)
            assert [r["id"] for r in replies] == [None, 5, 6, None, 8, 9]
            assert replies[5]["error"]["type"] == "NotReady"  # type: ignore[index]
            assert "has not registered" in replies[5]["error"]["message"]  # type: ignore[index]
            assert _exchange(raw, protocol.encode_request(10, "ping"))["ok"] is True
        finally:
            raw.close()
            ctx.term()
        assert client.lookup("still", TOKENS) == len(TOKENS)
        client.release("still")
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert 'flexkv_agent_engine_requests_total{op="invalid",outcome="error"} 5.0' in metrics

        # 4. SIGTERM: a clean stop, socket removed.
        assert stop_process(agent) == 0
        assert not Path(sock_path).exists()
        text = log.read_text()
        assert "Engine API closed" in text and 'service="stages"' in text
        # flexkv-agent keeps its copy lanes apart (node_agent.backend.lanes).
        assert "Copy lanes kept on separate CPUs" in text

        # 5. Agent restart: the cache is gone (index in memory), the engine's next call
        #    re-registers transparently.
        agent = start_agent_process(path, log)
        wait_healthy(url, agent)
        assert client.lookup("after", TOKENS) == 0
        status = httpx.get(url + "/status", timeout=5).json()
        assert status["stages"][0]["registeredRanks"] == [0]
        client.close()
    finally:
        stop_process(agent)
        if bufs is not None:
            bufs.close()


def test_cli_rejects_invalid_config_naming_key_and_fix(work: Path) -> None:
    path = work / "bad.yaml"
    path.write_text(yaml.safe_dump({"tiers": {"cpu": {"size": "8GB"}}}))
    out = subprocess.run([sys.executable, "-m", "node_agent", "run", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "tiers.cpu.size: '8GB' has unknown suffix 'GB'" in out.stderr
    env_bad = subprocess.run(
        [sys.executable, "-m", "node_agent", "run", "--config", str(_config(work)[0])],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "FLEXKV_PORTS_HTTP": "http"})
    assert env_bad.returncode == 2
    assert "ports.http: 'http' is not an integer" in env_bad.stderr


@pytest.mark.timeout(240)
def test_demo_runs_with_tiny_sizes_and_prints_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "node_agent", "demo", "--conversations", "3", "--turns", "2",
         "--system-tokens", "64", "--user-tokens", "16", "--reply-tokens", "16",
         "--layers", "2", "--kv-heads", "2", "--head-size", "16", "--cpu-size", "4Mi",
         "--timeout", "180"],
        capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout + out.stderr
    for needle in ("one PP group of 2 stages", "/status", "/metrics", "Results",
                   "hit rate (prompt tokens)", "prefill tokens saved", "all bit-exact",
                   "store bandwidth", "load bandwidth", "p50 ms", "p99 ms", "store_kv",
                   "Single-stage replicas of one model, per node", "cross-replica hits"):
        assert needle in out.stdout, needle
    hit = float(out.stdout.split("hit rate (prompt tokens)")[1].split("%")[0])
    assert hit > 0, "turn 2 repeats turn 1: some prompt tokens must hit"
    # One row per node: node-0 runs 4 replicas next to PP stage 0, node-1 one replica
    # next to PP stage 1; each node's replicas served all 6 requests of their
    # workload, every loaded token bit-exact, and the cross-replica hits are counted.
    rows = {m[0]: m[1:] for m in re.findall(
        r"^  (node-\d)\s+(\d+)/(\d+)\s+(\d+)\s+([\d.]+)%\s+(\d+) tok in (\d+) req\s+(\S+)$",
        out.stdout, re.MULTILINE)}
    assert sorted(rows) == ["node-0", "node-1"], out.stdout
    assert rows["node-0"][:3] == ("4", "4", "6") and rows["node-1"][:3] == ("1", "1", "6")
    for node, (*_, cross, cross_requests, verified) in rows.items():
        assert verified == "bit-exact", node
        assert (int(cross) > 0) == (int(cross_requests) > 0), node
    assert rows["node-1"][4:6] == ("0", "0"), "a lone replica has no other replica's hits"

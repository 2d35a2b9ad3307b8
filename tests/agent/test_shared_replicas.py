"""Replicas of one model on one agent (``maxStages`` > 1, ``ppSize`` 1) share one
backend: a prefix one replica stored is a hit for the others, also after its
engine is gone; a replica of another model never sees it. Agents are real
``python -m node_agent run`` processes; engines are the client library in this
process, or engine processes that are SIGKILLed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from node_agent.client import RankInfo, SharedKVBuffers
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    agent_mapping,
    short_dir,
    start_agent_process,
    stop_process,
    wait_healthy,
)
from tests.agent.test_several_stages import (
    BLOCK,
    MODEL_X,
    MODEL_Y,
    PROMPT,
    AgentProc,
    Engine,
    fill,
    metric,
    read,
    same,
)
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SRC = np.arange(0, 16, dtype=np.int64)
TAIL = np.arange(16, 32, dtype=np.int64)
SEED_A, SEED_B = 3, 4
BLOCKS = len(PROMPT) // LAYOUT.tokens_per_block
"""Blocks of ``PROMPT``."""
ROOT = Path(__file__).resolve().parents[2]

ENGINE_SCRIPT = """
import sys, time
import numpy as np
from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from tests.agent.harness import LAYOUT, NUM_SLOTS
from tests.agent.test_several_stages import fill, store_and_wait
from tests.agent.test_shared_replicas import PROMPT, SRC, TAIL
socket, replica, model, seed, mode = sys.argv[1:6]
client = EngineClient(socket, RankInfo(replica, model=model), timeout=10)
bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
client.register_kv_buffers(LAYOUT, bufs.handles)
fill(bufs, np.concatenate([SRC, TAIL]), int(seed))
store_and_wait(client, "first", PROMPT, SRC)
print("stored", flush=True)
if mode == "idle":
    time.sleep(3600)
i = 0
while True:  # stores that extend the shared prefix by a new block each
    tokens = np.concatenate([PROMPT, np.arange(16, dtype=np.int64) + 100000 + 16 * i])
    client.store_kv(f"s{i}", tokens, np.concatenate([SRC, TAIL]))
    if i == 3:
        print("storing", flush=True)
    i += 1
"""


def content(seed: int, slots: np.ndarray) -> list[Any]:
    """What an engine that filled ``slots`` with ``seed`` holds there, token by token."""
    ref = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    try:
        fill(ref, slots, seed)
        return read(ref, slots)
    finally:
        ref.close()


@pytest.fixture()
def work() -> Iterator[Path]:
    d = short_dir("share")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture()
def agent_of(work: Path) -> Iterator[Callable[..., AgentProc]]:
    """Starts one agent process in ``work`` (stopped at the end)."""
    started: list[AgentProc] = []

    def start(**extra: Any) -> AgentProc:
        data = agent_mapping(work, "solo", **extra)
        path = work / "solo.yaml"
        path.write_text(yaml.safe_dump(data))
        ap = AgentProc(data, start_agent_process(path, work / "solo.log"))
        started.append(ap)
        wait_healthy(ap.url, ap.proc)
        return ap

    try:
        yield start
    finally:
        for ap in started:
            stop_process(ap.proc)


@pytest.fixture()
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(socket: str, rank: RankInfo, register: bool = True) -> Engine:
        e = Engine(socket, rank)
        made.append(e)
        if register:
            e.register()
        return e

    try:
        yield make
    finally:
        for e in made:
            e.close()


@pytest.fixture()
def engine_process() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts engine processes running ``ENGINE_SCRIPT`` (killed at the end); each
    has stored ``PROMPT`` from its slots ``SRC`` when this returns."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(socket: str, replica: str, model: str, seed: int,
              mode: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE_SCRIPT, socket, replica, model, str(seed), mode],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert b"stored" in line, line + proc.stdout.read()
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def lookup_and_load(e: Engine, rid: str, tokens: np.ndarray, dst: np.ndarray) -> list[Any]:
    """Look ``tokens`` up and load the hit into ``dst``; the loaded content."""
    assert e.client.lookup(rid, tokens) == 16
    assert e.client.retrieve(rid, dst) == 16
    return read(e.bufs, dst)


def stages_of(agent: AgentProc) -> dict[str, dict[str, Any]]:
    return {s["replica"]: s for s in agent.status()["stages"]}


def test_a_prefix_one_replica_stored_is_a_hit_for_another_replica_of_its_model_after_it_is_gone(
        agent_of: Callable[..., AgentProc], engines: Callable[..., Engine],
        engine_process: Callable[..., subprocess.Popen[bytes]]) -> None:
    agent = agent_of(maxStages=3, tiers={"cpu": {"size": BLOCK * 48, "pinned": False}})
    a = engine_process(agent.socket, "rep-a", MODEL_X, SEED_A, "idle")
    b = engines(agent.socket, RankInfo("rep-b", model=MODEL_X))
    other = engines(agent.socket, RankInfo("other", model=MODEL_Y))
    fill(b.bufs, SRC, SEED_B)
    expected = content(SEED_A, SRC)
    # B hits what only A stored, and loads A's bytes bit-exact into its own slots.
    assert same(lookup_and_load(b, "get1", PROMPT, np.arange(64, 80)), expected)
    # A replica of another model never sees it.
    assert other.client.lookup("peek", PROMPT) == 0
    other.client.release("peek")
    stages = stages_of(agent)
    assert stages["rep-b"]["sharedBackend"]["replicas"] == ["rep-a", "rep-b"]
    assert stages["rep-a"]["sharedBackend"]["storedBlocks"] == BLOCKS
    assert stages["other"]["sharedBackend"]["replicas"] == ["other"]
    # Still a hit once A's engine process is SIGKILLed.
    a.kill()
    a.wait(timeout=10)
    assert same(lookup_and_load(b, "get2", PROMPT, np.arange(96, 112)), expected)
    # Still a hit once A's stage is gone too: a new replica's registration retires
    # the longest-idle stage (A's engine no longer calls) once it has been idle for
    # the agent's lease duration; B and the other model keep calling meanwhile.
    c = engines(agent.socket, RankInfo("rep-c", model=MODEL_X), register=False)

    def registered() -> bool:
        try:
            c.register()
            return True
        except ValueError as exc:
            assert "maxStages" in str(exc), exc
            b.client.poll_completed()
            other.client.poll_completed()
            return False

    wait_for(registered, "A's idle stage retired for a new replica", timeout=60)
    assert sorted(stages_of(agent)) == ["other", "rep-b", "rep-c"]
    assert same(lookup_and_load(c, "get3", PROMPT, np.arange(128, 144)), expected)
    assert same(lookup_and_load(b, "get4", PROMPT, np.arange(64, 80)), expected)
    stages = stages_of(agent)
    assert stages["rep-b"]["sharedBackend"] == {
        "replicas": ["rep-b", "rep-c"], "storedBlocks": 0, "crossHitBlocks": 3 * BLOCKS}
    assert stages["rep-b"]["traffic"]["hitTokens"] == 48
    text = httpx.get(agent.url + "/metrics", timeout=5).text
    assert metric(text, "flexkv_agent_replica_cross_hit_tokens_total", replica="rep-b") == 48
    assert metric(text, "flexkv_agent_replica_cross_hit_tokens_total", replica="rep-c") == 16
    # The shared backend's tiers count once in the agent's totals.
    assert agent.status()["tiers"]["cpu"] == {"capacityBytes": BLOCK * 48,
                                              "usedBytes": BLOCK * BLOCKS}

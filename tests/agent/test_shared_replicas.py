"""Replicas of one model on one agent (``maxStages`` > 1, ``ppSize`` 1) share one
backend: a prefix one replica stored is a hit for the others, also after its
engine is gone; a replica of another model never sees it. Agents are real
``python -m node_agent run`` processes; engines are the client library in this
process, or engine processes that are SIGKILLed."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
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
    AgentProcess,
    agent_starter,
)
from tests.agent.test_several_stages import (
    BLOCK,
    MODEL_X,
    MODEL_Y,
    PROMPT,
    Engine,
    fill,
    metric,
    read,
    same,
    store_and_wait,
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
    if i == 10:  # the shared backend's 20 blocks are full by now
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
def agent_of(work: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Starts one agent process, ``solo``, in ``work`` (stopped at the end)."""
    with agent_starter(work) as start:
        yield lambda **extra: start("solo", **extra)


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


def wait_completed(e: Engine, rid: str) -> None:
    """Wait until the agent reports ``rid``'s store done to ``e``."""
    done: list[str] = []

    def finished() -> bool:
        done.extend(e.client.wait_completed(0.2))
        return rid in done

    wait_for(finished, f"store {rid} completed", timeout=30)


def stages_of(agent: AgentProcess) -> dict[str, dict[str, Any]]:
    return {s["replica"]: s for s in agent.status()["stages"]}


def test_a_prefix_one_replica_stored_is_a_hit_for_another_replica_of_its_model_after_it_is_gone(
        agent_of: Callable[..., AgentProcess], engines: Callable[..., Engine],
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
    # Routers' read-only lookup answers the same through the shared index.
    for replica, hit in (("rep-b", len(PROMPT)), ("other", 0)):
        r = httpx.post(agent.url + "/v1/lookup", timeout=10,
                       json={"tokenIds": PROMPT.tolist(), "replica": replica, "ppRank": 0})
        assert r.status_code == 200, r.text
        assert r.json()["cachedTokens"] == hit, (replica, r.json())
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


def test_a_busy_replica_evicts_the_least_recently_used_blocks_of_any_replica_of_its_model(
        agent_of: Callable[..., AgentProcess], engines: Callable[..., Engine]) -> None:
    # Two stages' worth of CPU tier: the shared backend holds one share, 32 blocks.
    agent = agent_of(maxStages=2, tiers={"cpu": {"size": BLOCK * 64, "pinned": False}})
    a = engines(agent.socket, RankInfo("rep-a", model=MODEL_X))
    b = engines(agent.socket, RankInfo("rep-b", model=MODEL_X))
    fill(a.bufs, SRC, SEED_A)
    fill(b.bufs, SRC, SEED_B)
    hot, cold = PROMPT + 1000, PROMPT + 2000
    store_and_wait(a.client, "hot", hot, SRC)
    store_and_wait(a.client, "cold", cold, SRC)
    busy = [PROMPT + 10000 + 100 * i for i in range(20)]  # 80 blocks, 2.5 shares
    for i, prompt in enumerate(busy):
        store_and_wait(b.client, f"busy{i}", prompt, SRC)
        # A keeps using its hot prompt: it stays the most recently used.
        assert a.client.lookup(f"touch{i}", hot) == 16
        a.client.release(f"touch{i}")
    # Plain LRU over both replicas' blocks: A's hot prompt stays, its cold one and
    # B's oldest prompts went first, B's newest stays.
    assert same(lookup_and_load(a, "hot", hot, np.arange(64, 80)), content(SEED_A, SRC))
    assert same(lookup_and_load(b, "newest", busy[-1], np.arange(64, 80)),
                content(SEED_B, SRC))
    for e, rid, prompt in ((a, "cold", cold), (b, "oldest", busy[0])):
        assert e.client.lookup(rid, prompt) == 0
        e.client.release(rid)
    cpu = agent.status()["tiers"]["cpu"]
    assert 0 < cpu["usedBytes"] <= BLOCK * 32
    assert cpu["capacityBytes"] == BLOCK * 64


def test_replicas_storing_the_same_prefix_at_once_store_it_once(
        agent_of: Callable[..., AgentProcess], engines: Callable[..., Engine]) -> None:
    agent = agent_of(maxStages=2, tiers={"cpu": {"size": BLOCK * 64, "pinned": False}})
    a = engines(agent.socket, RankInfo("rep-a", model=MODEL_X))
    b = engines(agent.socket, RankInfo("rep-b", model=MODEL_X))
    fill(a.bufs, SRC, SEED_A)
    fill(b.bufs, SRC, SEED_B)
    seeds = {"rep-a": SEED_A, "rep-b": SEED_B}
    for n in range(5):
        prompt = PROMPT + 3000 + 100 * n

        def put(e: Engine, rid: str = f"put{n}", tokens: np.ndarray = prompt) -> int:
            return e.client.store_kv(rid, tokens, SRC)

        with ThreadPoolExecutor(2) as ex:
            tasks = list(ex.map(put, (a, b)))
        # One put stores the blocks; the other finds them cached or being stored.
        assert sorted(t >= 0 for t in tasks) == [False, True], tasks
        winner = (a, b)[tasks.index(max(tasks))]
        wait_completed(winner, f"put{n}")
        expected = content(seeds[winner.client.rank.replica], SRC)
        for e in (a, b):
            assert same(lookup_and_load(e, f"get{n}", prompt, np.arange(64, 80)), expected)
    stages = stages_of(agent)
    stored = sum(s["sharedBackend"]["storedBlocks"] for s in stages.values())
    assert stored == 5 * BLOCKS
    assert agent.status()["tiers"]["cpu"]["usedBytes"] == BLOCK * 5 * BLOCKS


def test_a_replica_killed_mid_store_or_sending_bad_input_never_disturbs_another_loading_its_blocks(
        agent_of: Callable[..., AgentProcess], engines: Callable[..., Engine],
        engine_process: Callable[..., subprocess.Popen[bytes]]) -> None:
    # The shared backend holds 20 blocks: A's stores soon evict, while B loads
    # (each load pins its blocks; A's puts and B's lookups keep PROMPT recent).
    agent = agent_of(maxStages=3, tiers={"cpu": {"size": BLOCK * 60, "pinned": False}})
    # A stored PROMPT, then keeps storing prompts that extend it by a new block run.
    a = engine_process(agent.socket, "rep-a", MODEL_X, SEED_A, "loop")
    b = engines(agent.socket, RankInfo("rep-b", model=MODEL_X))
    bad = engines(agent.socket, RankInfo("rep-bad", model=MODEL_X))
    expected = content(SEED_A, SRC)
    errors: list[BaseException] = []
    rounds = [0]
    stop = threading.Event()

    def load_shared_blocks() -> None:
        try:
            while not stop.is_set():
                n = rounds[0]
                dst = np.arange(64, 80) + 16 * (n % 4)
                assert same(lookup_and_load(b, f"get{n}", PROMPT, dst), expected)
                rounds[0] = n + 1
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=load_shared_blocks)
    worker.start()
    try:
        # Bad input from a third replica of the model: refused, naming what failed.
        with pytest.raises(ValueError, match="kv_indices"):
            bad.client.store_kv("x", PROMPT + 7, np.arange(NUM_SLOTS, NUM_SLOTS + 16))
        assert a.stdout is not None
        line = a.stdout.readline()
        assert b"storing" in line, line
        a.kill()  # mid-store: its puts were sent without waiting for completion
        a.wait(timeout=10)
        seen = rounds[0]
        wait_for(lambda: rounds[0] >= seen + 3 or bool(errors),
                 "B kept loading A's blocks after A was killed", timeout=60)
        text = httpx.get(agent.url + "/metrics", timeout=5).text
        assert metric(text, "flexkv_agent_evictions_total", tier="cpu") > 0
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not errors, errors
    assert rounds[0] >= 3
    # B still stores and loads prompts of its own.
    fill(b.bufs, SRC, SEED_B)
    store_and_wait(b.client, "own", PROMPT + 5000, SRC)
    assert same(lookup_and_load(b, "own", PROMPT + 5000, np.arange(64, 80)),
                content(SEED_B, SRC))


def test_a_new_cache_epoch_flushes_the_blocks_every_replica_of_the_model_shares(
        agent_of: Callable[..., AgentProcess], engines: Callable[..., Engine],
        work: Path) -> None:
    agent = agent_of(maxStages=2, tiers={"cpu": {"size": BLOCK * 64, "pinned": False}})
    a = engines(agent.socket, RankInfo("rep-a", model=MODEL_X))
    b = engines(agent.socket, RankInfo("rep-b", model=MODEL_X))
    fill(a.bufs, SRC, SEED_A)
    store_and_wait(a.client, "put", PROMPT, SRC)
    assert b.client.lookup("peek", PROMPT) == 16
    b.client.release("peek")
    path = work / "solo.yaml"
    path.write_text(yaml.safe_dump({**agent.data, "cacheEpoch": 1}))
    wait_for(lambda: agent.status()["cacheEpoch"] == 1, "the agent applied cacheEpoch 1",
             timeout=60)
    for e in (a, b):
        assert e.client.lookup("after", PROMPT) == 0
        e.client.release("after")
    # The new epoch's blocks are shared again.
    fill(b.bufs, SRC, SEED_B)
    store_and_wait(b.client, "again", PROMPT, SRC)
    assert same(lookup_and_load(a, "again", PROMPT, np.arange(64, 80)), content(SEED_B, SRC))


def test_replicas_of_one_model_on_one_tier_share_hold_the_whole_budget_until_they_are_gone(
        agent_of: Callable[..., AgentProcess], engines: Callable[..., Engine]) -> None:
    # maxStages 4 but one tier share: the one backend of model X's replicas gets
    # the whole 32-block CPU tier, not a quarter of it.
    budget = BLOCK * 32
    agent = agent_of(maxStages=4, tierShares=1,
                     tiers={"cpu": {"size": budget, "pinned": False}})
    reps = [engines(agent.socket, RankInfo(f"rep-{i}", model=MODEL_X)) for i in range(3)]
    big = np.arange(5000, 5000 + 16 * LAYOUT.tokens_per_block, dtype=np.int64)
    slots = np.arange(0, len(big))
    dst = np.arange(128, 128 + len(big))
    fill(reps[0].bufs, slots, SEED_A)
    store_and_wait(reps[0].client, "big", big, slots)
    # 16 blocks, twice a quarter of the budget: all of them stay cached, and another
    # replica loads them bit-exact.
    assert reps[2].client.lookup("get1", big) == len(big)
    assert reps[2].client.retrieve("get1", dst) == len(big)
    assert same(read(reps[2].bufs, dst), content(SEED_A, slots))
    status = agent.status()
    assert status["tiers"]["cpu"] == {"capacityBytes": budget, "usedBytes": BLOCK * 16}
    assert {s["replica"]: s["tiers"]["cpu"] for s in status["stages"]} == {
        f"rep-{i}": {"capacityBytes": budget, "usedBytes": BLOCK * 16} for i in range(3)}
    # A replica of another model needs a backend of its own: refused although
    # maxStages has room, naming tierShares, maxStages and the fix.
    other = engines(agent.socket, RankInfo("other", model=MODEL_Y), register=False)
    with pytest.raises(ValueError) as refused:
        other.register()
    message = str(refused.value)
    assert "all tierShares (1) shares of the agent's tiers are held" in message, message
    assert "(maxStages 4): raise tierShares" in message, message
    assert sorted(stages_of(agent)) == ["rep-0", "rep-1", "rep-2"]
    # A fourth replica of the model joins its backend.
    reps.append(engines(agent.socket, RankInfo("rep-3", model=MODEL_X)))
    assert reps[3].client.lookup("get2", big) == len(big)
    reps[3].client.release("get2")
    # Once no replica of the model called for the lease duration, the registration
    # retires all of them, which frees the share: the other model's backend gets
    # the whole budget in turn.

    def registered() -> bool:
        try:
            other.register()
            return True
        except ValueError as exc:
            # Refused for lack of a stage (four served) or of a tier share.
            assert "maxStages" in str(exc), exc
            return False

    wait_for(registered, "the idle replicas of model X retired for another model", timeout=60)
    assert sorted(stages_of(agent)) == ["other"]
    assert other.client.lookup("peek", big) == 0
    other.client.release("peek")
    fill(other.bufs, slots, SEED_B)
    store_and_wait(other.client, "big-y", big, slots)
    assert other.client.lookup("get3", big) == len(big)
    assert other.client.retrieve("get3", dst) == len(big)
    assert same(read(other.bufs, dst), content(SEED_B, slots))
    assert agent.status()["tiers"]["cpu"] == {"capacityBytes": budget, "usedBytes": BLOCK * 16}

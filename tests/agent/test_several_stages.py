"""One agent process serving several stages at once (``maxStages``): replicas of one
model, a replica of another model, and stages of two PP groups on one pair of
agents. Engines are the client library in this process (and one engine process
that is killed); agents are real ``python -m node_agent run`` processes."""

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
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.engine_api.identity import ModelIdentity
from node_agent.pp.auth import CurveKeys
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    AgentProcess,
    agent_mapping,
    agent_starter,
)
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MODEL_X = ModelIdentity(served_name="llama", model="/models/llama", revision="v1").digest()
MODEL_Y = ModelIdentity(served_name="llama", model="/models/llama-ft", revision="v1").digest()
PROMPT = np.arange(2000, 2016, dtype=np.int64)
SRC, DST = np.arange(0, 16, dtype=np.int64), np.arange(64, 80, dtype=np.int64)
BLOCK = LAYOUT.bytes_per_block


@pytest.fixture()
def agents(work: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Starts agent processes in ``work`` (stopped at the end): see
    :func:`~tests.agent.harness.agent_starter`."""
    with agent_starter(work) as start:
        yield start


def fill(bufs: SharedKVBuffers, slots: np.ndarray, seed: int) -> None:
    """Write content unique to ``seed`` into ``slots`` of every buffer."""
    for g, group in enumerate(bufs.tensors):
        for layer, t in enumerate(group):
            n = len(slots) * t[0].numel()
            vals = (np.arange(n, dtype=np.float32) % 512 + 1000 * seed + 100 * g + 10 * layer)
            t[slots] = torch.from_numpy(vals.reshape(len(slots), *t.shape[1:])).to(t.dtype)


def read(bufs: SharedKVBuffers, slots: np.ndarray) -> list[torch.Tensor]:
    return [t[slots].clone() for group in bufs.tensors for t in group]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def store_and_wait(client: EngineClient, rid: str, tokens: np.ndarray,
                   slots: np.ndarray) -> None:
    """Store ``tokens`` from ``slots`` and wait until the agent reports ``rid`` done."""
    assert client.store_kv(rid, tokens, slots) >= 0
    done: list[str] = []

    def finished() -> bool:
        done.extend(client.wait_completed(0.2))
        return rid in done

    wait_for(finished, f"store {rid} completed", timeout=30)


class Engine:
    """One engine rank: its client and its own shared-memory KV buffers."""

    def __init__(self, socket: str, rank: RankInfo) -> None:
        self.client = EngineClient(socket, rank, timeout=10)
        self.bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)

    def register(self) -> None:
        self.client.register_kv_buffers(LAYOUT, self.bufs.handles)

    def close(self) -> None:
        self.client.close()
        self.bufs.close()


@pytest.fixture()
def engines() -> Iterator[Callable[[str, RankInfo], Engine]]:
    made: list[Engine] = []

    def make(socket: str, rank: RankInfo) -> Engine:
        e = Engine(socket, rank)
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            e.close()


def test_replicas_without_a_model_identity_or_of_another_model_load_only_their_own_blocks(
        agents: Callable[..., AgentProcess], engines: Callable[[str, RankInfo], Engine],
        work: Path) -> None:
    # Three stages' worth of CPU and SSD tier: each stage's shares hold 16 blocks each
    # (the SSD tiers of the three stages share one directory). Replicas without a
    # model identity never share a backend: their models cannot be told apart.
    agent = agents("solo", maxStages=3,
                   tiers={"cpu": {"size": BLOCK * 48, "pinned": False},
                          "ssd": {"size": BLOCK * 48, "paths": [str(work / "ssd")]}})
    a = engines(agent.socket, RankInfo("rep-a"))
    b = engines(agent.socket, RankInfo("rep-b"))
    c = engines(agent.socket, RankInfo("other", model=MODEL_Y))
    a.register()
    # The agent reports the node's budget, also while one stage holds a share of it.
    assert agent.status()["tiers"]["cpu"]["capacityBytes"] == BLOCK * 48
    for seed, e in enumerate((a, b, c)):
        e.register()
        fill(e.bufs, SRC, seed)
    # The same prompt, stored by each replica from its own buffers.
    for e in (a, b, c):
        store_and_wait(e.client, "put", PROMPT, SRC)
    for e in (a, b, c):
        assert e.client.lookup("get", PROMPT) == 16
        assert e.client.retrieve("get", DST) == 16
        assert same(read(e.bufs, DST), read(e.bufs, SRC)), e.client
    # A prompt only replica A stored: no other stage, of its model or another, hits it.
    store_and_wait(a.client, "only-a", PROMPT + 500, SRC)
    assert [e.client.lookup("peek", PROMPT + 500) for e in (a, b, c)] == [16, 0, 0]
    for e in (a, b, c):
        e.client.release("peek")
    status = agent.status()
    stages = {s["replica"]: s for s in status["stages"]}
    assert sorted(stages) == ["other", "rep-a", "rep-b"]
    used = {"rep-a": BLOCK * 8, "rep-b": BLOCK * 4, "other": BLOCK * 4}
    for r, s in stages.items():
        assert s["tiers"]["cpu"] == {"capacityBytes": BLOCK * 16, "usedBytes": used[r]}
        assert s["tiers"]["ssd"]["capacityBytes"] == BLOCK * 16
    assert status["tiers"]["cpu"] == {"capacityBytes": BLOCK * 48, "usedBytes": BLOCK * 16}
    assert status["tiers"]["ssd"]["capacityBytes"] == BLOCK * 48
    # A fourth stage does not fit while the three are in use.
    d = engines(agent.socket, RankInfo("rep-d"))
    with pytest.raises(ValueError, match=r"as many as its maxStages \(3\)"):
        d.register()
    assert a.client.lookup("again", PROMPT) == 16
    # Each replica's traffic, in /status and in the per-replica metrics; the tier
    # gauges show the agent's totals, not one stage's share.
    stages = {s["replica"]: s for s in agent.status()["stages"]}
    assert {r: (s["traffic"]["lookupTokens"], s["traffic"]["hitTokens"])
            for r, s in stages.items()} == {"rep-a": (48, 48), "rep-b": (32, 16),
                                            "other": (32, 16)}
    assert stages["rep-a"]["traffic"]["calls"]["lookup"] == 3
    text = httpx.get(agent.url + "/metrics", timeout=5).text
    assert metric(text, "flexkv_agent_replica_lookup_tokens_total", replica="rep-a") == 48
    assert metric(text, "flexkv_agent_replica_hit_tokens_total", replica="rep-b") == 16
    assert metric(text, "flexkv_agent_replica_requests_total", replica="other",
                  op="store_kv") == 1
    assert metric(text, "flexkv_agent_tier_capacity_bytes", tier="cpu") == BLOCK * 48
    assert metric(text, "flexkv_agent_tier_used_bytes", tier="cpu") == BLOCK * 16


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of ``name`` with exactly ``labels`` in /metrics ``text``."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels} in /metrics")


ENGINE_SCRIPT = """
import sys
import numpy as np
from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from tests.agent.harness import LAYOUT, NUM_SLOTS
client = EngineClient(sys.argv[1], RankInfo("doomed"), timeout=10)
bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
client.register_kv_buffers(LAYOUT, bufs.handles)
i = 0
while True:
    client.store_kv(f"s{i}", np.arange(64, dtype=np.int64) + 64 * i, np.arange(64))
    client.lookup(f"l{i}", np.arange(64, dtype=np.int64))
    if i == 3:
        print("storing", flush=True)
    i += 1
"""


def test_bad_input_or_killed_engine_of_one_replica_never_disturbs_another(
        agents: Callable[..., AgentProcess], engines: Callable[[str, RankInfo], Engine],
        work: Path) -> None:
    agent = agents("solo", maxStages=3,
                   tiers={"cpu": {"size": BLOCK * 96, "pinned": False}})
    steady = engines(agent.socket, RankInfo("steady"))
    bad = engines(agent.socket, RankInfo("bad"))
    steady.register()
    bad.register()
    fill(steady.bufs, SRC, 7)
    errors: list[BaseException] = []
    rounds = [0]
    stop = threading.Event()

    def steady_traffic() -> None:
        try:
            while not stop.is_set():
                n = rounds[0]
                prompt = PROMPT + 100 * n  # a new prompt each round: each one is stored
                store_and_wait(steady.client, f"put{n}", prompt, SRC)
                assert steady.client.lookup(f"get{n}", prompt) == 16
                assert steady.client.retrieve(f"get{n}", DST) == 16
                assert same(read(steady.bufs, DST), read(steady.bufs, SRC))
                rounds[0] = n + 1
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=steady_traffic)
    worker.start()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, agent.socket],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              cwd=Path(__file__).resolve().parents[2])
    try:
        # Bad input from another replica: refused, naming what failed.
        with pytest.raises(ValueError, match="kv_indices"):
            bad.client.store_kv("x", PROMPT, np.arange(NUM_SLOTS, NUM_SLOTS + 16))
        # An engine of a third replica killed while it stores.
        assert engine.stdout is not None
        line = engine.stdout.readline()
        assert b"storing" in line, line
        engine.kill()
        engine.wait(timeout=10)
        seen = rounds[0]
        wait_for(lambda: rounds[0] >= seen + 3 or errors, "steady replica kept served",
                 timeout=60)
    finally:
        stop.set()
        worker.join(timeout=60)
        if engine.poll() is None:
            engine.kill()
            engine.wait(timeout=10)
    assert not errors, errors
    assert rounds[0] >= 3
    replicas = sorted(s["replica"] for s in agent.status()["stages"])
    assert replicas == ["bad", "doomed", "steady"]


def write_groups(path: Path, pool: str, groups: dict[str, dict[int, tuple[str, int]]]) -> None:
    """A KVCacheGroup list file: replica -> ppRank -> (node, fan-out port); the
    leader of each group is its stage 0."""
    items = []
    for replica, stages in groups.items():
        members = [{"node": node, "ppRank": r, "fanoutEndpoint": f"tcp://127.0.0.1:{port}",
                    "ready": True} for r, (node, port) in sorted(stages.items())]
        items.append({"metadata": {"name": f"{pool}-{replica}"},
                      "spec": {"poolRef": pool, "replica": replica, "ppSize": len(stages)},
                      "status": {"epoch": 1, "leader": members[0], "members": members}})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"items": items}))
    tmp.replace(path)


def test_stages_of_two_pp_groups_on_one_pair_of_agents_lead_one_and_follow_the_other(
        agents: Callable[..., AgentProcess], engines: Callable[[str, RankInfo], Engine],
        work: Path) -> None:
    CurveKeys.generate().write(work / "curve")
    groups_file = work / "groups.yaml"
    extra = {"maxStages": 2, "groupViewFile": str(groups_file),
             "tiers": {"cpu": {"size": BLOCK * 64, "pinned": False}}}
    maps = {n: agent_mapping(work, n, **extra) for n in ("node-p", "node-q")}
    port = {n: m["ports"]["fanout"] for n, m in maps.items()}
    # Group "ga": stage 0 (leader) on p, stage 1 on q; group "gb" the other way round.
    write_groups(groups_file, "tp", {
        "ga": {0: ("node-p", port["node-p"]), 1: ("node-q", port["node-q"])},
        "gb": {0: ("node-q", port["node-q"]), 1: ("node-p", port["node-p"])}})
    p, q = (agents(n, m) for n, m in maps.items())
    stages = {
        "ga": [engines(p.socket, RankInfo("ga", 0, 2)), engines(q.socket, RankInfo("ga", 1, 2))],
        "gb": [engines(q.socket, RankInfo("gb", 0, 2)), engines(p.socket, RankInfo("gb", 1, 2))],
    }
    for g, pair in enumerate(stages.values()):
        for r, e in enumerate(pair):
            e.register()
            fill(e.bufs, SRC, 10 * g + r)

    def on_both(call: Callable[[Engine], Any], pair: list[Engine]) -> list[Any]:
        with ThreadPoolExecutor(2) as ex:
            return list(ex.map(call, pair))

    def ready(ap: AgentProcess) -> bool:
        return httpx.get(ap.url + "/readyz", timeout=5).status_code == 200

    wait_for(lambda: ready(p) and ready(q), "both agents ready", timeout=60)
    with ThreadPoolExecutor(2) as groups:  # the two groups' calls run at once
        def serve(pair: list[Engine]) -> list[int]:
            on_both(lambda e: store_and_wait(e.client, "put", PROMPT, SRC), pair)
            hits = on_both(lambda e: e.client.lookup("get", PROMPT), pair)
            loaded = on_both(lambda e: e.client.retrieve("get", DST), pair)
            return [*hits, *loaded]

        results = list(groups.map(serve, stages.values()))
    assert results == [[16, 16, 16, 16], [16, 16, 16, 16]]
    for pair in stages.values():
        for e in pair:
            assert same(read(e.bufs, DST), read(e.bufs, SRC))
    roles = {(s["replica"], s["ppRank"]): s["role"] for s in p.status()["stages"]}
    assert roles == {("ga", 0): "leader", ("gb", 1): "follower"}
    roles = {(s["replica"], s["ppRank"]): s["role"] for s in q.status()["stages"]}
    assert roles == {("ga", 1): "follower", ("gb", 0): "leader"}


def test_the_stop_spill_budget_is_shared_by_the_stages_of_an_agent() -> None:
    from node_agent.assembly import STOP_SPILL_SECONDS, backend_config, stage_share
    from node_agent.config import config_from_mapping
    from tests.agent.harness import LAYOUT

    for max_stages in (1, 4):
        data = {"pool": "p", "nodeName": "n", "tokensPerBlock": LAYOUT.tokens_per_block,
                "maxStages": max_stages, "tiers": {"cpu": {"size": "64Mi"}}}
        cfg = stage_share(config_from_mapping(data))
        per_stage = backend_config(cfg, LAYOUT).stop_spill_seconds
        assert per_stage * max_stages == pytest.approx(STOP_SPILL_SECONDS)

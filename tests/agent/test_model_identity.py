"""Two models of one KV shape on one agent never share a block: engines in this
process (the client library) against a real agent process with a CPU and an SSD
tier, under one replica name.

Model X stores two prompts (the CPU tier holds one, so the first goes to the SSD
tier); an engine restart of model X still hits both; an engine of model Y (same
layout, other weights) that registers the replica gets a miss for both, and the
calls of the engine of model X are refused from then on, naming both models."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from node_agent.client import EngineAPIError, EngineClient, RankInfo, SharedKVBuffers
from node_agent.engine_api.identity import ModelIdentity
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    agent_process,
    short_dir,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

MODEL_X = ModelIdentity(served_name="llama", model="/models/llama", revision="v1",
                        tokenizer="/models/llama").digest()
MODEL_Y = ModelIdentity(served_name="llama", model="/models/llama-ft", revision="v1",
                        tokenizer="/models/llama").digest()
PROMPTS = [np.arange(1000, 1064, dtype=np.int64), np.arange(5000, 5064, dtype=np.int64)]


@pytest.fixture()
def agent() -> Iterator[tuple[str, str]]:
    work = short_dir("model")
    block = LAYOUT.bytes_per_block
    tiers = {"cpu": {"size": block * 16, "pinned": False},  # one prompt
             "ssd": {"size": block * 64, "paths": [str(work / "ssd")]}}
    try:
        with agent_process(work, tiers=tiers) as running:
            yield running.socket, running.url
    finally:
        shutil.rmtree(work, ignore_errors=True)


def hits(url: str, tier: str) -> float:
    name = f'flexkv_agent_hit_tokens_total{{tier="{tier}"}}'
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def engine(socket: str, model: str) -> tuple[EngineClient, SharedKVBuffers]:
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    client = EngineClient(socket, RankInfo(replica="eng-0", model=model), timeout=10)
    client.register_kv_buffers(LAYOUT, bufs.handles)
    return client, bufs


def store(client: EngineClient, rid: str, tokens: np.ndarray) -> None:
    assert client.store_kv(rid, tokens, np.arange(len(tokens), dtype=np.int64)) >= 0
    client.wait_completed(10)


def test_an_engine_of_another_model_never_gets_blocks_of_the_first_in_cpu_or_ssd(
        agent: tuple[str, str]) -> None:
    socket, url = agent
    x, x_bufs = engine(socket, MODEL_X)
    try:
        for i, tokens in enumerate(PROMPTS):
            store(x, f"x{i}", tokens)
        x.close()
        x_bufs.close()
        # An engine restart of the same model: equal identities share every block.
        x, x_bufs = engine(socket, MODEL_X)
        ssd_before = hits(url, "ssd")
        for i, tokens in enumerate(PROMPTS):
            assert x.lookup(f"again{i}", tokens) == len(tokens)
            x.release(f"again{i}")
        assert hits(url, "ssd") > ssd_before  # the first prompt came from the SSD tier

        y, y_bufs = engine(socket, MODEL_Y)
        try:
            cpu, ssd = hits(url, "cpu"), hits(url, "ssd")
            for i, tokens in enumerate(PROMPTS):
                assert y.lookup(f"y{i}", tokens) == 0
                y.release(f"y{i}")
            assert (hits(url, "cpu"), hits(url, "ssd")) == (cpu, ssd)
            # The engine of model X may not use the stage model Y registered.
            with pytest.raises(EngineAPIError) as refused:
                x.lookup("stale", PROMPTS[1])
            assert refused.value.error_type == "NotReady"
            assert MODEL_X in str(refused.value) and MODEL_Y in str(refused.value)
            # Model Y's own blocks are its own.
            store(y, "y-own", PROMPTS[1])
            assert y.lookup("y-own-again", PROMPTS[1]) == len(PROMPTS[1])
            y.release("y-own-again")
        finally:
            y.close()
            y_bufs.close()
        # Model X registering again gets none of model Y's blocks.
        x.register_kv_buffers(LAYOUT, x_bufs.handles)
        assert x.lookup("x-back", PROMPTS[1]) == 0
    finally:
        x.close()
        x_bufs.close()

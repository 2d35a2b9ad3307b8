"""SGLang ranks of two models of one KV shape on one agent never share a block:
the plugin's identity from SGLang's server arguments (``model_identity``, given a
stand-in for ``ServerArgs`` with the fields the wheel defines) reaches a real
agent process through the plugin's connector and client."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.integrations.sglang.connector import AgentKVConnector
from node_agent.integrations.sglang.settings import PluginSettings, model_identity
from tests.agent.harness import (
    LAYOUT,
    agent_process,
    short_dir,
)
from tests.sglang.stage import Handle
from tests.support.clock import ManualClock
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKENS = np.arange(700, 716, dtype=np.int64)


def server_args(model_path: str) -> SimpleNamespace:
    return SimpleNamespace(model_path=model_path, served_model_name="llama", revision=None,
                           tokenizer_path=model_path)


@pytest.fixture()
def agent() -> Iterator[str]:
    work = short_dir("sglm")
    try:
        with agent_process(work) as running:
            yield running.socket
    finally:
        shutil.rmtree(work, ignore_errors=True)


def rank(socket: str, args: SimpleNamespace, salt: str | None,
         bufs: SharedKVBuffers) -> AgentKVConnector:
    model = model_identity(args, salt).digest()
    client = EngineClient(socket, RankInfo(replica="sglang", model=model), timeout=10)
    conn = AgentKVConnector(client, LAYOUT, bufs.handles, page_size=LAYOUT.tokens_per_block,
                            retry_seconds=5)
    assert conn.connect() is True
    return conn


def test_ranks_of_other_weights_or_another_salt_never_hit_the_first_models_blocks(
        agent: str) -> None:
    bufs = SharedKVBuffers.for_layout(LAYOUT, 64)
    try:
        first = rank(agent, server_args("/models/llama"), None, bufs)
        assert first.store_kv(Handle("s1", 0), TOKENS.tolist(), torch.arange(16)) >= 0

        def stored() -> bool:
            first.check_completed_stores()
            return not first.stores_in_flight()

        wait_for(stored, "the store completed", 20, interval=0.02)
        task, hit = first.lookup_kv(TOKENS, None, Handle("s2", 0))
        assert task >= 0 and hit == len(TOKENS)
        first.release_pending(Handle("s2", 0))
        first.shutdown()
        # The same model restarted: equal identities share the blocks.
        again = rank(agent, server_args("/models/llama"), None, bufs)
        assert again.lookup_kv(TOKENS, None, Handle("s3", 0))[1] == len(TOKENS)
        again.release_pending(Handle("s3", 0))
        again.shutdown()
        for args, salt in ((server_args("/models/llama-ft"), None),
                           (server_args("/models/llama"), "weights-2")):
            other = rank(agent, args, salt, bufs)
            assert other.lookup_kv(TOKENS, None, Handle("o", 0)) == (-1, 0)
            other.shutdown()
    finally:
        bufs.close()


def test_the_model_salt_is_read_from_the_environment() -> None:
    settings = PluginSettings.from_env({"FLEXKV_AGENT_MODEL_SALT": "weights-2"})
    assert settings.model_salt == "weights-2"
    assert PluginSettings.from_env({}).model_salt is None
    args = server_args("/models/llama")
    assert (model_identity(args, "weights-2").digest()
            != model_identity(args, None).digest())




def test_a_rank_whose_replica_another_model_took_waits_for_a_probe(agent: str) -> None:
    """The agent answers the first model's rank ``NotReady`` once a rank of another
    model took the replica: the client's resilience policy takes the agent as not
    serving this rank, so no call is made until ``retry_seconds`` passed and a
    probe was answered; every call meanwhile is a local miss."""
    bufs = SharedKVBuffers.for_layout(LAYOUT, 64)
    clock = ManualClock()
    model = model_identity(server_args("/models/llama"), None).digest()
    client = EngineClient(agent, RankInfo(replica="sglang", model=model), timeout=10)
    first = AgentKVConnector(client, LAYOUT, bufs.handles, page_size=LAYOUT.tokens_per_block,
                             retry_seconds=5, clock=clock)
    other = None
    try:
        assert first.connect() is True
        other = rank(agent, server_args("/models/llama-ft"), None, bufs)
        assert first.lookup_kv(TOKENS, None, Handle("a", 0)) == (-1, 0)
        assert first.connected is False and first.health.down
        assert first.store_kv(Handle("a", 0), TOKENS.tolist(), torch.arange(16)) == -1
        assert first.stores_in_flight() == 0
        clock.now += 5  # the probe (a ping) is answered: calls resume, and are refused again
        assert first.lookup_kv(TOKENS, None, Handle("b", 0)) == (-1, 0)
        assert first.connected is False
    finally:
        first.shutdown()
        if other is not None:
            other.shutdown()
        bufs.close()

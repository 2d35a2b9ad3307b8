"""The vLLM worker's registration (``Registrar``) against a real agent process that
refuses it: the start-up error carries the agent's reason and only the fix that
applies (vLLM-free: the worker half runs here on buffers in shared memory)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from node_agent.client import RankInfo, SharedKVBuffers
from node_agent.integrations.vllm.config import AgentConnectorConfig, ConnectorConfigError
from node_agent.integrations.vllm.worker_side import Registrar
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName
from tests.agent.harness import short_dir, stop_process
from tests.vllm.harness import BLOCK, Agent

LAYERS, KV_HEADS, HEAD, BLOCKS = 2, 2, 64, 4
#: Idle stages are replaced only after this long: never during the test.
LEASE = {"leaseDurationSeconds": 600, "renewDeadlineSeconds": 300, "retryPeriodSeconds": 2}


@pytest.fixture(scope="module")
def agent() -> Iterator[Agent]:
    work = short_dir("vreg")
    a = Agent(Path(work), max_stages=1, extra={"heartbeat": LEASE})
    try:
        yield a
    finally:
        stop_process(a.proc)


def registrar(agent: Agent, replica: str, bufs: SharedKVBuffers,
              block_size: int = BLOCK) -> Registrar:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_size=HEAD,
                      dtype=KVDtype.BFLOAT16, tokens_per_block=block_size,
                      name=LayoutName.LAYER_BLOCK_HEAD_TOKEN_KV)
    cfg = AgentConnectorConfig(engine_socket=str(agent.socket), replica=replica)
    return Registrar(cfg, RankInfo(replica=replica, model="ab" * 16), layout, bufs.handles[0],
                     block_size)


def test_an_engine_beyond_max_stages_is_told_to_raise_max_stages_not_its_block_size(
        agent: Agent) -> None:
    shape = (BLOCKS, KV_HEADS, BLOCK, 2 * HEAD)
    with SharedKVBuffers([[shape] * LAYERS], torch.bfloat16) as first_bufs, \
            SharedKVBuffers([[shape] * LAYERS], torch.bfloat16) as second_bufs:
        first = registrar(agent, "first", first_bufs)
        second = registrar(agent, "second", second_bufs)
        try:
            assert first.register(at_start=True)
            with pytest.raises(ConnectorConfigError) as refused:
                second.register(at_start=True)
        finally:
            first.close()
            second.close()
    message = str(refused.value)
    assert "as many as its maxStages (1): raise maxStages" in message, message
    assert "--block-size" not in message, message


def test_a_block_size_other_than_the_pools_is_told_to_change_block_size(
        agent: Agent) -> None:
    shape = (BLOCKS, KV_HEADS, BLOCK // 2, 2 * HEAD)
    with SharedKVBuffers([[shape] * LAYERS], torch.bfloat16) as bufs:
        reg = registrar(agent, "small-blocks", bufs, block_size=BLOCK // 2)
        try:
            with pytest.raises(ConnectorConfigError) as refused:
                reg.register(at_start=True)
        finally:
            reg.close()
    message = str(refused.value)
    assert f"differs from the pool's tokensPerBlock {BLOCK}" in message, message
    assert message.endswith("vLLM's --block-size must equal the pool's tokensPerBlock"), message

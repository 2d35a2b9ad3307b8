"""``backend: flexkv`` in the agent: a one-stage group runs on FlexKV's manager (the
checking fake here), a multi-stage group is refused with an error that says why."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from node_agent.agent import Agent
from node_agent.assembly import default_stage_builder
from node_agent.engine_api.service import RankRef
from tests.agent.harness import LAYOUT, NUM_SLOTS, TPB, agent_mapping, cfg_of, short_dir
from tests.coordinator.harness import wait_completed
from tests.fake_flexkv import load_fake_flexkv


@pytest.fixture
def flexkv_agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    work = short_dir("fkvstage")
    try:
        with load_fake_flexkv(monkeypatch):
            yield Agent(cfg_of(agent_mapping(work, "node-0", backend="flexkv")),
                        default_stage_builder)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _buffers() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [[torch.randn(NUM_SLOTS, LAYOUT.heads_per_rank, LAYOUT.head_size, generator=gen)
             .to(LAYOUT.dtype.torch_dtype) for _ in range(LAYOUT.num_layers)]
            for _ in range(LAYOUT.kv_dim)]


def test_one_stage_group_round_trips_through_flexkv(flexkv_agent: Agent) -> None:
    import flexkv._fake as fake  # the fake on sys.path; records every manager

    stage = default_stage_builder(flexkv_agent.stage_deps, RankRef("rep", 0, 1, 0, 1), LAYOUT)
    conn = stage.coordinator
    try:
        bufs = _buffers()
        conn.register_kv_buffers(0, bufs)
        tokens = np.arange(4 * TPB, dtype=np.int64) + 100
        src = np.arange(4 * TPB, dtype=np.int64)            # pages 0..3
        assert conn.store_kv("a", tokens, torch.as_tensor(src)) >= 0
        wait_completed(conn, "a", 5)
        assert conn.lookup("b", tokens) == 4 * TPB
        dst = np.arange(8 * TPB, 12 * TPB, dtype=np.int64)  # pages 8..11
        assert conn.retrieve("b", dst) == 4 * TPB
        for plane in (0, 1):
            for layer in range(LAYOUT.num_layers):
                assert torch.equal(bufs[plane][layer][dst], bufs[plane][layer][src])
        assert len(fake.MANAGERS) == 1  # FlexKV's manager did the work, not another backend
    finally:
        conn.close()


def test_multi_stage_group_is_refused_naming_the_fix(flexkv_agent: Agent) -> None:
    with pytest.raises(ValueError, match=r"one-stage groups only.*ppSize 2.*backend: embedded"):
        default_stage_builder(flexkv_agent.stage_deps, RankRef("rep", 0, 2, 0, 1), LAYOUT)


def test_a_stage_of_a_model_hands_flexkv_its_model_namespace(flexkv_agent: Agent) -> None:
    """FlexKV keys blocks by namespace: a stage registered by an engine of a model
    passes the model's namespace on every match, so two models never share a block."""
    import flexkv._fake as fake

    from node_agent.engine_api.identity import ModelIdentity, stage_namespace

    model = ModelIdentity(model="/models/llama").digest()
    rank = RankRef("rep", 0, 1, 0, 1, model)
    stage = default_stage_builder(flexkv_agent.stage_deps, rank, LAYOUT)
    conn = stage.coordinator
    try:
        conn.register_kv_buffers(0, _buffers())
        tokens = np.arange(4 * TPB, dtype=np.int64) + 100
        conn.lookup("x", tokens)
        manager = fake.MANAGERS[-1]
        seen = [kw["namespace"] for name, kw in manager.calls if name == "get_match"]
        assert seen == [[stage_namespace(model, "")]]
    finally:
        conn.close()

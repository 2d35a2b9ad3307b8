"""The split of engineCallSeconds among the connector's waits (vocab/budget.py)
and its use by the stage builder and the engine API server."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.agent import Agent
from node_agent.assembly import coordinator_config, default_stage_builder
from node_agent.engine_api.service import RankRef
from node_agent.vocab.budget import call_budget
from tests.agent.harness import LAYOUT, agent_mapping, cfg_of, short_dir


@given(e=st.floats(0.2, 3600), frac=st.floats(0.001, 0.999))
def test_worst_case_chain_ends_a_margin_before_the_engine_call(e: float, frac: float) -> None:
    b = call_budget(e, e * frac)
    assert b.fanout_wait_seconds > 0 and b.transfer_seconds > 0
    assert b.fanout_wait_seconds <= e * frac
    assert b.margin_seconds >= 0.05
    assert b.worst_case_seconds == pytest.approx(e - b.margin_seconds)
    assert b.worst_case_seconds < e < b.server_timeout_seconds


def test_defaults_split() -> None:
    b = call_budget(10, 5)
    assert (b.margin_seconds, b.fanout_wait_seconds, b.transfer_seconds) == \
        pytest.approx((1.0, 4.5, 1.5))
    assert b.server_timeout_seconds == pytest.approx(11.0)


@pytest.mark.parametrize("fanout", [0, -1, 10, 11])
def test_fanout_wait_must_be_below_the_engine_call(fanout: float) -> None:
    with pytest.raises(ValueError, match=r"fanoutWaitSeconds .* below timeouts.engineCallSeconds"):
        call_budget(10, fanout)


def test_stage_and_server_use_the_split() -> None:
    work = short_dir("budget")
    try:
        mapping = agent_mapping(work, "node-0",
                                timeouts={"engineCallSeconds": 2, "fanoutWaitSeconds": 0.6})
        agent = Agent(cfg_of(mapping), default_stage_builder)
        ccfg = coordinator_config(agent.cfg, RankRef("rep", 0, 1, 0, 1), LAYOUT, "tp-rep", None)
        assert ccfg.fanout_wait_seconds == pytest.approx(0.6)
        assert ccfg.transfer_seconds == pytest.approx((1.8 - 0.6) / 3)
        assert ccfg.engine_call_seconds == 2
        assert agent.engine._timeout == pytest.approx(2.2)
    finally:
        shutil.rmtree(work, ignore_errors=True)

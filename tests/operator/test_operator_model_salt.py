"""``spec.modelSalt`` from the pool to the agents: the operator renders it into
agent.yaml only when set (existing pools keep their config hash), the agent reads
it, and it changes the namespace, so the block ids, of every stage."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from flexkv_operator import children, names
from flexkv_operator.children import PoolIdentity
from flexkv_operator.spec import ConfigInvalid, parse_pool_spec

from node_agent.config import config_from_mapping
from node_agent.engine_api.identity import ModelIdentity, stage_namespace

POOL = PoolIdentity("pool", "ns", {})
SPEC: dict[str, Any] = {"tiers": {"cpu": {"size": "1Gi"}}}


def _agent_yaml(spec: dict[str, Any]) -> dict[str, Any]:
    config = parse_pool_spec(spec, "img:1")
    return dict(yaml.safe_load(children.render_config_map(POOL, config)["data"][names.CONFIG_KEY]))


def test_a_pool_model_salt_reaches_the_agents_and_changes_every_stage_namespace() -> None:
    plain = _agent_yaml(SPEC)
    salted = _agent_yaml({**SPEC, "modelSalt": "weights-2"})
    assert "modelSalt" not in plain
    assert salted["modelSalt"] == "weights-2"
    assert config_from_mapping(plain).model_salt == ""
    agent = config_from_mapping(salted)
    assert agent.model_salt == "weights-2"
    model = ModelIdentity(model="/models/llama").digest()
    assert stage_namespace(model, agent.model_salt) != stage_namespace(model, "")
    assert stage_namespace("", agent.model_salt) is not None  # engines without an identity too
    config = parse_pool_spec(SPEC, "img:1")
    assert children.config_hash(POOL, config) != children.config_hash(
        POOL, parse_pool_spec({**SPEC, "modelSalt": "weights-2"}, "img:1"))


@pytest.mark.parametrize("salt", [7, "x" * 254])
def test_a_bad_model_salt_is_refused_naming_the_key_and_the_value(salt: object) -> None:
    with pytest.raises(ConfigInvalid) as err:
        parse_pool_spec({**SPEC, "modelSalt": salt}, "img:1")
    assert "modelSalt" in str(err.value) and "at most 253 characters" in str(err.value)

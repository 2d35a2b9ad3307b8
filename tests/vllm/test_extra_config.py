"""``kv_connector_extra_config`` parsing: defaults, every key, and refusals that name
the key, the bad value and the fix (vLLM-free: runs in the main venv)."""

from __future__ import annotations

import pytest

from node_agent.integrations.vllm.config import (
    DEFAULT_SOCKET,
    AgentConnectorConfig,
    ConnectorConfigError,
    model_identity,
    parse_extra_config,
)


def test_defaults_and_every_key() -> None:
    assert parse_extra_config(None) == AgentConnectorConfig()
    assert parse_extra_config({}).engine_socket == DEFAULT_SOCKET
    cfg = parse_extra_config({"engineSocket": "ipc:///run/a.sock", "replica": "llama",
                              "requireAgent": False, "callTimeoutSeconds": 20,
                              "lookupTimeoutSeconds": 0.5, "retrySeconds": 3,
                              "modelSalt": "weights-2"})
    assert cfg == AgentConnectorConfig("ipc:///run/a.sock", "llama", False, 20.0, 0.5, 3.0,
                                       "weights-2")


@pytest.mark.parametrize(("raw", "needle"), [
    ({"engineSockt": "/x"}, "key 'engineSockt' is unknown (value '/x'); allowed keys are"),
    ({"requireAgent": "yes"}, "requireAgent is 'yes'; it must be true or false"),
    ({"lookupTimeoutSeconds": 0}, "lookupTimeoutSeconds is 0; it must be a number of seconds > 0"),
    ({"retrySeconds": True}, "retrySeconds is True; it must be a number of seconds > 0"),
    ({"replica": ""}, "replica is ''; it must be a name of 1..253 characters"),
    ({"engineSocket": 5}, "engineSocket is 5; it must be a path"),
    ({"modelSalt": ""}, "modelSalt is ''; it must be a string of 1..253 characters"),
])
def test_bad_keys_and_values_name_key_value_and_fix(raw: dict[str, object], needle: str) -> None:
    with pytest.raises(ConnectorConfigError) as err:
        parse_extra_config(raw)
    assert needle in str(err.value)


def test_the_model_identity_covers_what_vllm_knows_of_the_model() -> None:
    class ModelConfig:  # the fields of vLLM's ModelConfig the identity reads
        served_model_name = ["llama", "llama-chat"]
        model = "/models/llama"
        revision = "v1"
        tokenizer = "/models/llama"
        tokenizer_revision = None

    ident = model_identity(ModelConfig(), "weights-2")
    assert (ident.served_name, ident.model, ident.revision, ident.tokenizer, ident.salt) == (
        "llama,llama-chat", "/models/llama", "v1", "/models/llama", "weights-2")
    other = ModelConfig()
    other.revision = "v2"  # type: ignore[misc]
    assert model_identity(other, "weights-2").digest() != ident.digest()
    assert model_identity(ModelConfig(), None).digest() != ident.digest()


@pytest.mark.parametrize("socket", [
    "/run/flexkv/engine-{pp_rank}.sock",
    "/run/flexkv/engine-{ppRank.sock",
    "/run/flexkv/engine-ppRank}.sock",
    "/run/flexkv/engine-{rank}.sock",
])
def test_an_engine_socket_field_other_than_pp_rank_is_refused(socket: str) -> None:
    with pytest.raises(ConnectorConfigError) as err:
        parse_extra_config({"engineSocket": socket})
    text = str(err.value)
    assert f"engineSocket is {socket!r}" in text
    assert "{ppRank}" in text


def test_the_pp_rank_field_names_each_stage_socket() -> None:
    cfg = parse_extra_config({"engineSocket": "/run/flexkv/engine-{ppRank}.sock"})
    assert [cfg.socket_for(r) for r in range(3)] == [
        "/run/flexkv/engine-0.sock", "/run/flexkv/engine-1.sock", "/run/flexkv/engine-2.sock"]
    plain = parse_extra_config({"engineSocket": "ipc:///run/flexkv/engine.sock"})
    assert plain.socket_for(1) == "ipc:///run/flexkv/engine.sock"

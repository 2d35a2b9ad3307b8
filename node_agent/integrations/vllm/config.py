"""``kv_connector_extra_config`` of the vLLM connector: keys, defaults, checks.

Every key is optional. A bad key or value raises :class:`ConnectorConfigError`
at start-up naming the key, the bad value and the fix (vLLM then refuses to
start). See docs/vllm.md for the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from node_agent.engine_api.identity import ModelIdentity

DEFAULT_SOCKET = "/var/run/flexkv/engine.sock"
#: Replaced by the stage's PP rank in ``engineSocket``.
PP_RANK_FIELD = "{ppRank}"


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` key or value is invalid."""


@dataclass(frozen=True)
class AgentConnectorConfig:
    """The validated extra config (camelCase keys on the wire)."""

    engine_socket: str = DEFAULT_SOCKET
    """The agent's engine socket (``engineSocket`` of agent.yaml), path or ``ipc://`` form.
    Under pipeline parallelism each stage calls the agent of its own node at this path;
    ``{ppRank}`` in it is replaced by the stage's PP rank (:meth:`socket_for`)."""
    replica: str = "vllm"
    """This engine's name at the agent, its stage: engines running at once on one agent
    each need their own (the agent serves up to its ``maxStages``); replicas of one
    model under different names share the agent's cache, and an engine restarted under
    the same name finds what it stored before."""
    require_agent: bool = True
    """Fail start-up when no agent listens on ``engine_socket``."""
    call_timeout_seconds: float = 15.0
    """Bound on each load / store call (above the agent's engineCallSeconds + margin)."""
    lookup_timeout_seconds: float = 2.0
    """Bound on the admission lookup, made in vLLM's scheduler loop."""
    retry_seconds: float = 2.0
    """After a call to the agent failed, skip it for this long (no call, no wait), then
    try again."""
    model_salt: str | None = None
    """Folded into this engine's model identity: engines of one model name and revision
    but other weights must use different salts (docs/vllm.md, model identity)."""

    def socket_for(self, pp_rank: int) -> str:
        """The engine socket of PP stage ``pp_rank``: ``engine_socket`` with ``{ppRank}``
        replaced by the rank (unchanged without it: one path, resolved on each node)."""
        return self.engine_socket.replace(PP_RANK_FIELD, str(pp_rank))


_KEYS: dict[str, tuple[str, type | tuple[type, ...], str]] = {
    "engineSocket": ("engine_socket", str, "a path such as /var/run/flexkv/engine.sock"),
    "replica": ("replica", str, "a name of 1..253 characters, e.g. llama-8b"),
    "requireAgent": ("require_agent", bool, "true or false"),
    "callTimeoutSeconds": ("call_timeout_seconds", (int, float), "a number of seconds > 0"),
    "lookupTimeoutSeconds": ("lookup_timeout_seconds", (int, float),
                             "a number of seconds > 0"),
    "retrySeconds": ("retry_seconds", (int, float), "a number of seconds > 0"),
    "modelSalt": ("model_salt", str, "a string of 1..253 characters, e.g. weights-2024-06"),
}


def parse_extra_config(raw: Mapping[str, Any] | None) -> AgentConnectorConfig:
    """Validate ``kv_connector_extra_config``; unknown keys are errors."""
    values: dict[str, Any] = {}
    for key, value in dict(raw or {}).items():
        if key not in _KEYS:
            raise ConnectorConfigError(
                f"kv_connector_extra_config key {key!r} is unknown (value {value!r}); "
                f"allowed keys are {', '.join(sorted(_KEYS))}"
            )
        field, types, fix = _KEYS[key]
        bad_type = not isinstance(value, types) or (isinstance(value, bool) and types is not bool)
        if bad_type:
            raise ConnectorConfigError(
                f"kv_connector_extra_config.{key} is {value!r}; it must be {fix}"
            )
        if types is str and not 0 < len(value) <= 253:
            raise ConnectorConfigError(
                f"kv_connector_extra_config.{key} is {value!r}; it must be {fix}"
            )
        if types == (int, float) and not value > 0:
            raise ConnectorConfigError(
                f"kv_connector_extra_config.{key} is {value!r}; it must be {fix}"
            )
        if key == "engineSocket":
            _check_socket_fields(value)
        values[field] = float(value) if types == (int, float) else value
    return AgentConnectorConfig(**values)


def _check_socket_fields(socket: str) -> None:
    """Refuse a brace in ``engineSocket`` outside the ``{ppRank}`` field: a misspelt
    field would otherwise stay in the path, and every stage would look for an agent
    socket literally named so."""
    if "{" in socket.replace(PP_RANK_FIELD, "") or "}" in socket.replace(PP_RANK_FIELD, ""):
        raise ConnectorConfigError(
            f"kv_connector_extra_config.engineSocket is {socket!r}; the only field it may "
            f"contain is {PP_RANK_FIELD} (replaced by each stage's PP rank), e.g. "
            "/run/flexkv/engine-{ppRank}.sock"
        )


def model_identity(model_config: Any, salt: str | None) -> ModelIdentity:
    """The identity of the model vLLM serves, from its ``ModelConfig``: served model
    name, model path or id, revision, tokenizer and tokenizer revision, and ``salt``
    (``kv_connector_extra_config.modelSalt``)."""

    def text(name: str) -> str | None:
        value = getattr(model_config, name, None)
        if value is None:
            return None
        if isinstance(value, list | tuple):
            return ",".join(str(v) for v in value)
        return str(value)

    return ModelIdentity(served_name=text("served_model_name"), model=text("model"),
                         revision=text("revision"), tokenizer=text("tokenizer"),
                         tokenizer_revision=text("tokenizer_revision"), salt=salt)

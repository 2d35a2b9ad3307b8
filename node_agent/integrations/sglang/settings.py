"""Plugin settings, read from the environment of the SGLang process.

SGLang has no command-line flags for plugins, so the pod spec sets these
variables (docs/sglang.md has a snippet):

* ``FLEXKV_AGENT_SOCKET`` (default ``/var/run/flexkv/engine.sock``): the agent's
  ``engineSocket``, as a path or an ``ipc://`` endpoint;
* ``FLEXKV_AGENT_REPLICA`` (default ``sglang``, only when ``pp_size == 1``): the
  PP group name, the same on every stage of one replica and unique per replica;
* ``FLEXKV_AGENT_TIMEOUT`` (15): the client's bound per call, in seconds; it must
  exceed the agent's ``engineCallSeconds`` plus its margin (docs/agent.md);
* ``FLEXKV_AGENT_RETRY_SECONDS`` (5): how long an absent or silent agent is left
  alone before the next try;
* ``FLEXKV_AGENT_ORPHAN_STORE_SECONDS`` (120): a store the agent never reports
  releases its radix node after this long;
* ``FLEXKV_AGENT_MODEL_SALT`` (unset): folded into the model identity
  (:func:`model_identity`); engines of one model path and revision but other
  weights must set different salts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from node_agent.engine_api.identity import ModelIdentity

DEFAULT_SOCKET = "/var/run/flexkv/engine.sock"


@dataclass(frozen=True)
class PluginSettings:
    """Where the agent is and how long to wait for it."""

    socket: str = DEFAULT_SOCKET
    replica: str | None = None
    timeout: float = 15.0
    retry_seconds: float = 5.0
    orphan_store_seconds: float = 120.0
    model_salt: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginSettings:
        """Read the ``FLEXKV_AGENT_*`` variables; a bad value raises ``ValueError``
        naming the variable, the value and the fix."""
        env = os.environ if env is None else env
        return cls(
            socket=env.get("FLEXKV_AGENT_SOCKET", DEFAULT_SOCKET) or DEFAULT_SOCKET,
            replica=env.get("FLEXKV_AGENT_REPLICA") or None,
            timeout=_seconds(env, "FLEXKV_AGENT_TIMEOUT", 15.0),
            retry_seconds=_seconds(env, "FLEXKV_AGENT_RETRY_SECONDS", 5.0),
            orphan_store_seconds=_seconds(env, "FLEXKV_AGENT_ORPHAN_STORE_SECONDS", 120.0),
            model_salt=env.get("FLEXKV_AGENT_MODEL_SALT") or None,
        )

    def replica_for(self, pp_size: int) -> str:
        """The group name for a replica of ``pp_size`` stages.

        A PP replica spans nodes, and its stages find each other in the agents'
        group by this name, so it must be given explicitly."""
        if self.replica is not None:
            return self.replica
        if pp_size > 1:
            raise ValueError(
                f"FLEXKV_AGENT_REPLICA is not set but SGLang runs {pp_size} PP stages; set it "
                "to the same name on every stage of this replica (unique per replica), "
                "e.g. the name of the replica's LeaderWorkerSet group"
            )
        return "sglang"


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number; give seconds, e.g. {default:g}") \
            from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={text!r} must be a finite number of seconds > 0, "
                         f"e.g. {default:g}")
    return value


def model_identity(server_args: Any, salt: str | None) -> ModelIdentity:
    """The identity of the model SGLang serves, from its ``ServerArgs``: served model
    name, model path, revision, tokenizer path and revision, and ``salt``
    (``FLEXKV_AGENT_MODEL_SALT``). The agent keys this engine's blocks by it."""

    def text(name: str) -> str | None:
        value = getattr(server_args, name, None)
        return None if value is None else str(value)

    return ModelIdentity(served_name=text("served_model_name"), model=text("model_path"),
                         revision=text("revision"), tokenizer=text("tokenizer_path"),
                         tokenizer_revision=text("tokenizer_revision"), salt=salt)

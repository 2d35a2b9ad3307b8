"""What the operator mounts into an agent pod and the agent reads there
(docs/contracts.md sections 1, 4 and 5)."""

from __future__ import annotations

#: Key of the agent configuration in the ``<pool>-agent-config`` ConfigMap, and
#: the directory the ConfigMap is mounted at.
CONFIG_KEY = "agent.yaml"
CONFIG_MOUNT = "/etc/flexkv"
#: Where the ``<pool>-curve`` Secret is mounted (the agent's default ``curveKeyDir``)
#: and its two keys, Z85 text.
CURVE_MOUNT = f"{CONFIG_MOUNT}/curve"
CURVE_PUBLIC_KEY = "curve-public.key"
CURVE_SECRET_KEY = "curve-secret.key"
#: Where an agent reads its keys from when the files are absent.
ENV_CURVE_PUBLIC_KEY = "FLEXKV_CURVE_PUBLIC_KEY"
ENV_CURVE_SECRET_KEY = "FLEXKV_CURVE_SECRET_KEY"
#: The hostPath directory of the ``ipc://`` engine socket and the socket in it.
ENGINE_SOCKET_DIR = "/var/run/flexkv"
ENGINE_SOCKET = f"{ENGINE_SOCKET_DIR}/engine.sock"
#: Downward-API variables of the agent container and the agent-local key each fills.
DOWNWARD_ENV = {
    "NODE_NAME": "nodeName",
    "POD_NAME": "podName",
    "POD_UID": "podUid",
    "POD_IP": "advertiseAddress",
}

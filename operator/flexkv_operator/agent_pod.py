"""What an agent pod may touch on its node and the network: host directories, their
owner, privileges, container ports.

The agent container runs as the pool's non-root user (``spec.agent.securityContext``,
by default the image's user 10001:10001) with every capability dropped, no
privilege escalation and a read-only root filesystem. The kubelet creates
``DirectoryOrCreate`` hostPaths as ``root:root 0755``, which that user cannot
write, so an init container from the same image runs ``chown`` on exactly those
directories, as root with every capability dropped except ``CHOWN``. The paths
travel as argv (never through a shell), and ``spec.py`` has already refused system
directories and paths not in normal form (:mod:`flexkv_operator.host_paths`).

Host directories (each mounted at the same path in both containers, except the
shared-memory one, which becomes the containers' ``/dev/shm``):

* the engine-socket directory, where the agent binds its ``ipc://`` socket;
* :data:`~flexkv_operator.host_paths.SHM_HOST_DIR`, the node's tmpfs directory for
  CPU KV buffers: engines create POSIX shared-memory segments by name (``shm_open``
  resolves a name to ``/dev/shm/<name>``) and the agent opens them by the same
  name, which works across pods only when both mount this directory at ``/dev/shm``;
* each SSD tier directory.

Container ports (:func:`container_ports`): ``http`` and ``fanout``, and with a remote
tier Mooncake's ``mooncake`` (``storePort``) and ``mooncake-data`` (``storePort + 1``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from flexkv_operator.host_paths import ENGINE_SOCKET_DIR, SHM_HOST_DIR, SHM_MOUNT, TMP_MOUNT
from flexkv_operator.spec import PoolConfig

INIT_CONTAINER = "own-host-dirs"


@dataclass(frozen=True)
class HostDirs:
    """The pod's hostPath volumes, their mounts, and the in-container paths to chown."""

    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    paths: list[str]


def host_dirs(config: PoolConfig) -> HostDirs:
    """Engine socket, shared memory and SSD directories, in that order."""
    entries = [
        ("engine-socket", ENGINE_SOCKET_DIR, ENGINE_SOCKET_DIR),
        ("shm", SHM_HOST_DIR, SHM_MOUNT),
    ]
    entries += [(f"ssd-{i}", path, path) for i, path in enumerate(config.ssd_paths)]
    return HostDirs(
        volumes=[
            {"name": name, "hostPath": {"path": host, "type": "DirectoryOrCreate"}}
            for name, host, _ in entries
        ],
        mounts=[{"name": name, "mountPath": mount} for name, _, mount in entries],
        paths=[mount for _, _, mount in entries],
    )


# The agent's /tmp holds small files only (HOME caches, FlexKV's ipc sockets);
# the kubelet evicts the pod rather than let it fill the node's disk.
SCRATCH_SIZE_LIMIT = "1Gi"
# Requests a pool that sets none gets: the agent's event loop, and the CPU tier
# plus the Python process (torch, pyzmq, uvicorn).
DEFAULT_CPU_REQUEST = "250m"
MEMORY_OVERHEAD_BYTES = 512 * 2**20


STORE_PORT_NAME = "mooncake"
"""The agent's Mooncake RPC / handshake port (``storePort``)."""
DATA_PORT_NAME = "mooncake-data"
"""The agent's Mooncake TCP data port (``storePort + 1``)."""
KV_EVENTS_PORT_NAME = "kv-events"
"""The agent's KV-event PUB port (``spec.kvEvents.port``), for routers."""


def container_ports(config: PoolConfig) -> list[dict[str, Any]]:
    """The agent container's named ports: HTTP, the PP fan-out, the KV events when
    ``spec.kvEvents`` is set and, with a remote tier,
    Mooncake's RPC (``storePort``) and data (``storePort + 1``) ports."""
    ports = [
        {"name": "http", "containerPort": config.http_port, "protocol": "TCP"},
        {"name": "fanout", "containerPort": config.fanout_port, "protocol": "TCP"},
    ]
    if config.kv_events is not None:
        ports.append({"name": KV_EVENTS_PORT_NAME, "containerPort": config.kv_events.port,
                      "protocol": "TCP"})
    if config.remote is not None:
        # Both pinned by the agent (MC_LEGACY_RPC_PORT_BINDING=1, MC_MIN_RPC_PORT =
        # MC_MAX_RPC_PORT = storePort + 1); named for the chart's NetworkPolicy.
        store = config.remote.store_port
        ports += [
            {"name": STORE_PORT_NAME, "containerPort": store, "protocol": "TCP"},
            {"name": DATA_PORT_NAME, "containerPort": store + 1, "protocol": "TCP"},
        ]
    return ports


def scratch_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent's writable ``/tmp`` (HOME of the image; FlexKV's own ipc directory)."""
    return ({"name": "tmp", "emptyDir": {"sizeLimit": SCRATCH_SIZE_LIMIT}},
            {"name": "tmp", "mountPath": TMP_MOUNT})


def agent_resources(config: PoolConfig) -> dict[str, Any]:
    """The pool's ``agent.resources``, with a request for CPU and memory where the pool
    sets neither a request nor a limit (Kubernetes takes a lone limit as the request),
    so a minimal pool is Burstable, never BestEffort, and its memory request covers
    the CPU tier and the remote tier's segment and staging buffer."""
    resources = copy.deepcopy(config.raw["agent"].get("resources") or {})
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    defaults = {"cpu": DEFAULT_CPU_REQUEST,
                "memory": str(config.cpu_bytes + remote_bytes(config) + MEMORY_OVERHEAD_BYTES)}
    for name, value in defaults.items():
        if name not in requests and name not in limits:
            requests[name] = value
    if requests:
        resources["requests"] = requests
    return resources


def remote_bytes(config: PoolConfig) -> int:
    """Memory the remote tier takes in each agent: its segment and staging buffer."""
    remote = config.remote
    return 0 if remote is None else remote.segment_bytes + remote.local_buffer_bytes


def agent_security_context(config: PoolConfig) -> dict[str, Any]:
    """The agent container's: the pool's non-root user, nothing else."""
    return {
        "runAsUser": config.agent_user,
        "runAsGroup": config.agent_group,
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security_context() -> dict[str, Any]:
    """Pod-wide settings both containers share."""
    return {"seccompProfile": {"type": "RuntimeDefault"}}


def chown_init_container(config: PoolConfig, dirs: HostDirs) -> dict[str, Any]:
    """Init container that hands ``dirs`` (not their contents) to the agent's user.

    Root is needed only to change an owner, so every other capability is dropped;
    ``--`` ends chown's options, so no path can be read as one.
    """
    agent = config.raw["agent"]
    return {
        "name": INIT_CONTAINER,
        "image": config.image,
        "imagePullPolicy": agent["imagePullPolicy"],
        "command": ["chown", "--", f"{config.agent_user}:{config.agent_group}", *dirs.paths],
        # The pod's effective request is the larger of init and app containers, so
        # the agent's own resources keep quotas and limit ranges satisfied.
        "resources": agent_resources(config),
        "securityContext": {
            "runAsUser": 0,
            "runAsGroup": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
        "volumeMounts": [dict(m) for m in dirs.mounts],
    }

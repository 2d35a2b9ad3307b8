"""The remote tier's Mooncake side: the agents' settings and a pool's managed master.

With ``spec.tiers.remote.mooncake.managed: true`` the operator runs one
``mooncake_master`` per pool: a Deployment ``<pool>-mooncake-master`` (one replica,
``Recreate``, so two masters never split the pool's metadata) from the *agent image*,
which carries the binary of the ``remote`` extra, and a ClusterIP Service of the same
name. The master serves its RPC on :data:`RPC_PORT` and its built-in HTTP metadata
server on :data:`METADATA_PORT`; the agents' ``agent.yaml`` then names
``<pool>-mooncake-master.<ns>.svc`` for both. The master needs no Kubernetes API
access (no ServiceAccount token), runs as the agent image's non-root user with a
read-only root filesystem, and keeps everything in memory: a restarted master starts
empty and the agents register again.

Each agent's Mooncake client listens on two ports the agent pins itself (docs/remote.md):
RPC / handshake on ``storePort`` and TCP data on ``storePort + 1``; the agent DaemonSet
declares them by name (:func:`flexkv_operator.agent_pod.container_ports`).

Mooncake has no authentication: whoever reaches these ports can read and write the
pool's cached KV. The chart's NetworkPolicies restrict them (docs/helm.md).
"""

from __future__ import annotations

import copy
from typing import Any

from flexkv_operator import names
from flexkv_operator.agent_pod import agent_security_context
from flexkv_operator.host_paths import TMP_MOUNT
from flexkv_operator.spec import PoolConfig, RemoteTier

RPC_PORT = 50051
METADATA_PORT = 8080
METRICS_PORT = 9003
METADATA_PATH = "/metadata"
COMPONENT = "mooncake-master"
DEFAULT_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}}
SCRATCH_SIZE_LIMIT = "64Mi"


def master_host(pool: str, namespace: str) -> str:
    """The managed master Service's DNS name."""
    return f"{names.mooncake_master_name(pool)}.{namespace}.svc"


def master_endpoints(pool: str, namespace: str, remote: RemoteTier) -> tuple[str, str]:
    """(masterAddress, metadataServer) the agents use: the pool's Service when managed,
    the configured ones otherwise."""
    if not remote.managed:
        return remote.master_address, remote.metadata_server
    host = master_host(pool, namespace)
    return f"{host}:{RPC_PORT}", f"http://{host}:{METADATA_PORT}{METADATA_PATH}"


def agent_remote_section(pool: str, namespace: str, config: PoolConfig) -> dict[str, Any]:
    """``tiers.remote`` of agent.yaml (docs/contracts.md section 1). Sizes are passed
    as written in the pool (bytes or a quantity)."""
    remote = config.remote
    assert remote is not None
    written = config.raw["tiers"]["remote"]["mooncake"]
    address, metadata = master_endpoints(pool, namespace, remote)
    return {
        "writePolicy": remote.write_policy,
        "queueBlocks": remote.queue_blocks,
        "timeoutSeconds": remote.timeout_seconds,
        "mooncake": {
            "masterAddress": address,
            "metadataServer": metadata,
            "protocol": remote.protocol,
            "deviceName": remote.device_name,
            "segmentSize": written.get("segmentSize", remote.segment_bytes),
            "localBufferSize": written.get("localBufferSize", remote.local_buffer_bytes),
            "storePort": remote.store_port,
        },
    }


def master_args() -> list[str]:
    """``mooncake_master`` flags (gflags of mooncake-transfer-engine 0.3.13): RPC and the
    built-in HTTP metadata server on every address, metrics and ``/health`` on
    :data:`METRICS_PORT`, logs to stderr (no log files on the read-only root), and the
    metadata of agents whose heartbeat lapsed removed with them."""
    return [
        "--rpc_address=0.0.0.0",
        f"--rpc_port={RPC_PORT}",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=0.0.0.0",
        f"--http_metadata_server_port={METADATA_PORT}",
        f"--metrics_port={METRICS_PORT}",
        "--enable_metadata_cleanup_on_timeout=true",
        "--logtostderr=true",
    ]


def master_labels(pool: str) -> dict[str, str]:
    """Labels of the master's objects and pods; never the agents' selector labels, so
    the agents' Services and PodDisruptionBudget do not select the master."""
    return {
        **names.common_labels(pool),
        names.LABEL_NAME: names.MOONCAKE_MASTER_APP,
        names.LABEL_COMPONENT: COMPONENT,
    }


def master_selector(pool: str) -> dict[str, str]:
    return {names.LABEL_NAME: names.MOONCAKE_MASTER_APP, names.LABEL_INSTANCE: pool}


def master_resources(remote: RemoteTier) -> dict[str, Any]:
    """The pool's ``master.resources``, or a small request when it sets none."""
    return copy.deepcopy(remote.master_resources) or copy.deepcopy(DEFAULT_RESOURCES)


def _meta(pool: str, namespace: str, owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": names.mooncake_master_name(pool),
        "namespace": namespace,
        "labels": master_labels(pool),
        "ownerReferences": [owner],
    }


def _master_container(config: PoolConfig, remote: RemoteTier) -> dict[str, Any]:
    """The ``mooncake_master`` container: the agent image, its ports and probes, the
    pool's ``master.resources`` and the agent's security context."""
    return {
        "name": "mooncake-master",
        "image": config.image,
        "imagePullPolicy": config.raw["agent"]["imagePullPolicy"],
        "command": ["mooncake_master"],
        "args": master_args(),
        "ports": [
            {"name": "rpc", "containerPort": RPC_PORT, "protocol": "TCP"},
            {"name": "metadata", "containerPort": METADATA_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        # Ready when clients can reach the RPC server; alive while the metadata server
        # answers its /health.
        "readinessProbe": {
            "tcpSocket": {"port": "rpc"},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "metadata"},
            "initialDelaySeconds": 5,
            "periodSeconds": 10,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "resources": master_resources(remote),
        "securityContext": agent_security_context(config),
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_MOUNT}],
    }


def render_master_deployment(
    pool: str, namespace: str, owner: dict[str, Any], config: PoolConfig
) -> dict[str, Any]:
    """The managed master's Deployment (unstamped; :mod:`children` stamps it)."""
    remote = config.remote
    assert remote is not None and remote.managed
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(pool, namespace, owner),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": master_selector(pool)},
            "template": {
                "metadata": {"labels": master_labels(pool)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "terminationGracePeriodSeconds": 10,
                    "containers": [_master_container(config, remote)],
                    "volumes": [
                        {"name": "tmp", "emptyDir": {"sizeLimit": SCRATCH_SIZE_LIMIT}}
                    ],
                    "priorityClassName": config.raw["agent"].get("priorityClassName") or None,
                },
            },
        },
    }


def render_master_service(pool: str, namespace: str, owner: dict[str, Any]) -> dict[str, Any]:
    """The managed master's ClusterIP Service (unstamped)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, namespace, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": master_selector(pool),
            "ports": [
                {"name": "rpc", "port": RPC_PORT, "targetPort": "rpc", "protocol": "TCP"},
                {
                    "name": "metadata",
                    "port": METADATA_PORT,
                    "targetPort": "metadata",
                    "protocol": "TCP",
                },
            ],
        },
    }

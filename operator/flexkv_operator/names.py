"""Names and labels of everything the operator creates for a pool."""

from __future__ import annotations

from flexkv_operator import crds
from node_agent.contract import files, kube

LABEL_NAME = kube.LABEL_NAME
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_POOL = kube.LABEL_POOL
LABEL_NODE = kube.LABEL_NODE
AGENT_APP = kube.AGENT_APP
MOONCAKE_MASTER_APP = "flexkv-mooncake-master"
MANAGER = "flexkv-operator"

ANNOTATION_CONFIG_HASH = "flexkv.io/config-hash"
# What the agents read back is written once, in node_agent.contract (docs/contracts.md).
ANNOTATION_ENDPOINTS = kube.ANNOTATION_ENDPOINTS
ANNOTATION_MEMBERSHIPS = kube.ANNOTATION_MEMBERSHIPS
ANNOTATION_TIERS = kube.ANNOTATION_TIERS
ANNOTATION_READY = kube.ANNOTATION_READY
ANNOTATION_CACHE_EPOCH = kube.ANNOTATION_CACHE_EPOCH
ANNOTATION_LOOKUPS = kube.ANNOTATION_LOOKUPS

CONFIG_KEY = files.CONFIG_KEY
CONFIG_MOUNT = files.CONFIG_MOUNT
CURVE_MOUNT = files.CURVE_MOUNT
ENGINE_SOCKET_DIR = files.ENGINE_SOCKET_DIR
ENGINE_SOCKET = files.ENGINE_SOCKET
CURVE_PUBLIC_KEY = files.CURVE_PUBLIC_KEY
CURVE_SECRET_KEY = files.CURVE_SECRET_KEY

lease_name = kube.lease_name
"""Name of the heartbeat Lease an agent keeps (docs/contracts.md section 2)."""
group_name = kube.group_name
"""``<pool>-<replica>`` lowercased, invalid characters replaced by ``-``, at most 253 chars."""


def agent_name(pool: str) -> str:
    """DaemonSet, PDB and ServiceAccount-facing name of a pool's agents."""
    return f"{pool}-agent"


def config_map_name(pool: str) -> str:
    return f"{pool}-agent-config"


def curve_secret_name(pool: str) -> str:
    return f"{pool}-curve"


def headless_service_name(pool: str) -> str:
    """Headless Service for PP fan-out between agents."""
    return f"{pool}-agents"


def local_service_name(pool: str) -> str:
    """Node-local Service (internalTrafficPolicy: Local) engines use to reach their agent."""
    return f"{pool}-agent-local"


def mooncake_master_name(pool: str) -> str:
    """Deployment and Service of a pool's managed mooncake_master (``managed: true``)."""
    return f"{pool}-mooncake-master"


# A managed master's Service, ``<pool>-mooncake-master``, must be a DNS-1035 label.
MAX_MANAGED_MASTER_POOL_NAME = 63 - len("-mooncake-master")


def selector_labels(pool: str) -> dict[str, str]:
    """Labels that select a pool's agent pods (immutable once a DaemonSet exists)."""
    return {LABEL_NAME: AGENT_APP, LABEL_INSTANCE: pool}


def common_labels(pool: str) -> dict[str, str]:
    """Labels on every child object of a pool."""
    return {
        **selector_labels(pool),
        LABEL_MANAGED_BY: MANAGER,
        LABEL_POOL: pool,
        "app.kubernetes.io/part-of": "flexkv",
    }


def owner_reference(pool_body: dict[str, object]) -> dict[str, object]:
    """Controller owner reference to the pool, for garbage collection of children."""
    meta = pool_body.get("metadata")
    if not isinstance(meta, dict) or not meta.get("uid") or not meta.get("name"):
        raise ValueError("Pool body needs metadata.name and metadata.uid for owner references")
    return {
        "apiVersion": crds.API_VERSION,
        "kind": crds.POOL_KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }

"""Kubernetes names both sides use: the CRDs, the agent Lease (docs/contracts.md
section 2) and the ``KVCacheGroup`` (section 3)."""

from __future__ import annotations

import re

#: The API group and served version of both CRDs.
CRD_GROUP = "flexkv.io"
CRD_VERSION = "v1alpha1"
API_VERSION = f"{CRD_GROUP}/{CRD_VERSION}"
POOL_KIND = "KVCachePool"
POOL_PLURAL = "kvcachepools"
GROUP_KIND = "KVCacheGroup"
GROUP_PLURAL = "kvcachegroups"

#: Labels of an agent's Lease: ``LABEL_NAME: AGENT_APP``, the pool and the node.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_POOL = "flexkv.io/pool"
LABEL_NODE = "flexkv.io/node"
AGENT_APP = "flexkv-agent"

#: The Lease's annotations (JSON values, except ``ready`` and ``cache-epoch``).
#: ``lookups`` is optional: an agent whose backend does not count lookups omits it.
ANNOTATION_ENDPOINTS = "flexkv.io/endpoints"
ANNOTATION_MEMBERSHIPS = "flexkv.io/memberships"
ANNOTATION_TIERS = "flexkv.io/tiers"
ANNOTATION_READY = "flexkv.io/ready"
ANNOTATION_CACHE_EPOCH = "flexkv.io/cache-epoch"
ANNOTATION_LOOKUPS = "flexkv.io/lookups"
#: How far back the ``lookups`` annotation counts, at most (seconds).
LOOKUP_WINDOW_SECONDS = 300
LEASE_ANNOTATIONS = (
    ANNOTATION_ENDPOINTS,
    ANNOTATION_MEMBERSHIPS,
    ANNOTATION_TIERS,
    ANNOTATION_READY,
    ANNOTATION_CACHE_EPOCH,
    ANNOTATION_LOOKUPS,
)

_INVALID_NAME = re.compile(r"[^a-z0-9-]+")
_MAX_NAME = 253


def lease_name(node: str) -> str:
    """``flexkv-agent-<nodeName>``: the heartbeat Lease an agent keeps."""
    return f"{AGENT_APP}-{node}"


def group_name(pool: str, replica: str) -> str:
    """The ``KVCacheGroup`` name of a replica: ``<pool>-<replica>`` lowercased, every
    run of characters outside ``[a-z0-9-]`` replaced by ``-``, trimmed of ``-``, at
    most 253 characters (``group`` when nothing is left)."""
    raw = _INVALID_NAME.sub("-", f"{pool}-{replica}".lower()).strip("-")
    return raw[:_MAX_NAME].rstrip("-") or "group"

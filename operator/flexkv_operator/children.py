"""Pure rendering of a pool's child objects (no I/O).

Each ``render_*`` returns the complete desired manifest for one child. The
operator stamps every rendering with :data:`ANNOTATION_SPEC_HASH` so it can tell
whether a live child is current without comparing server-defaulted fields.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import yaml

from flexkv_operator import agent_pod, mooncake, names
from flexkv_operator.spec import PoolConfig
from node_agent.contract import files

ANNOTATION_SPEC_HASH = "flexkv.io/spec-hash"


@dataclass(frozen=True)
class PoolIdentity:
    """What every child needs to know about its pool."""

    name: str
    namespace: str
    owner: dict[str, Any]


def digest(obj: Any) -> str:
    """Stable short hash of a JSON-able value."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def agent_config(pool: PoolIdentity, config: PoolConfig) -> dict[str, Any]:
    """The agent.yaml document of docs/contracts.md section 1."""
    raw = config.raw
    tiers: dict[str, Any] = {
        "cpu": {"size": raw["tiers"]["cpu"]["size"], "pinned": raw["tiers"]["cpu"]["pinned"]}
    }
    if config.copy_lanes is not None:
        # Absent unless set: the agent.yaml (and config hash) of other pools is unchanged.
        tiers["cpu"]["copyLanes"] = config.copy_lanes
    if config.ssd_paths:
        tiers["ssd"] = {"size": raw["tiers"]["ssd"]["size"], "paths": list(config.ssd_paths),
                        "persist": raw["tiers"]["ssd"].get("persist", True)}
    if config.remote is not None:
        tiers["remote"] = mooncake.agent_remote_section(pool.name, pool.namespace, config)
    eviction = raw["eviction"]
    return {
        "pool": pool.name,
        "namespace": pool.namespace,
        "backend": config.backend,
        "tokensPerBlock": config.tokens_per_block,
        "cacheEpoch": config.cache_epoch,
        **({"modelSalt": config.model_salt} if config.model_salt else {}),
        "tiers": tiers,
        "eviction": {
            "policy": eviction["policy"],
            "highWatermark": eviction["highWatermark"],
            "lowWatermark": eviction["lowWatermark"],
        },
        "ports": {"http": config.http_port, "fanout": config.fanout_port},
        "engineSocket": names.ENGINE_SOCKET,
        "timeouts": dict(raw["timeouts"]),
        "heartbeat": {
            "leaseDurationSeconds": config.timings.lease_duration,
            "renewDeadlineSeconds": config.timings.renew_deadline,
            "retryPeriodSeconds": config.timings.retry_period,
        },
        "curveKeyDir": names.CURVE_MOUNT,
        "expectedRanks": config.expected_ranks,
        # Absent for one stage: the agent.yaml (and config hash) of such pools is unchanged.
        **({"maxStages": config.max_stages} if config.max_stages != 1 else {}),
        # Absent unless set: the agent.yaml (and config hash) of other pools is unchanged.
        **({"tierShares": config.tier_shares} if config.tier_shares is not None else {}),
        # Absent unless set: the agent.yaml (and config hash) of other pools is unchanged.
        **({"kvEvents": {"endpoint": f"tcp://*:{config.kv_events.port}",
                         "blockHash": config.kv_events.block_hash,
                         "hashSeed": config.kv_events.hash_seed,
                         "intBlockHashes": config.kv_events.int_block_hashes}}
           if config.kv_events is not None else {}),
    }


def config_hash(pool: PoolIdentity, config: PoolConfig) -> str:
    """Hash of agent.yaml without cacheEpoch: a spec change rolls the agents, an epoch bump
    does not (agents re-read the mounted file and flush in place)."""
    doc = agent_config(pool, config)
    doc.pop("cacheEpoch")
    return digest(doc)


def _meta(
    pool: PoolIdentity, name: str, extra_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": {**names.common_labels(pool.name), **(extra_labels or {})},
        "ownerReferences": [pool.owner],
    }


def _stamp(manifest: dict[str, Any]) -> dict[str, Any]:
    manifest["metadata"].setdefault("annotations", {})[ANNOTATION_SPEC_HASH] = digest(manifest)
    return manifest


def render_config_map(pool: PoolIdentity, config: PoolConfig) -> dict[str, Any]:
    text = yaml.safe_dump(agent_config(pool, config), sort_keys=False)
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(pool, names.config_map_name(pool.name)),
            "data": {names.CONFIG_KEY: text},
        }
    )


def render_curve_secret(pool: PoolIdentity, public: str, secret: str) -> dict[str, Any]:
    """The CurveZMQ Secret; keys are generated once by the caller and never re-rendered."""

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(pool, names.curve_secret_name(pool.name)),
        "data": {names.CURVE_PUBLIC_KEY: b64(public), names.CURVE_SECRET_KEY: b64(secret)},
    }


def _probe(path: str, period: int, failure: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failure,
    }


def _pod_annotations(pool: PoolIdentity, config: PoolConfig) -> dict[str, str]:
    """The agent pods' annotations: the config hash (a change rolls the pods) and,
    with ``monitoring.scrapeAnnotations``, Prometheus' scrape annotations."""
    annotations = {names.ANNOTATION_CONFIG_HASH: config_hash(pool, config)}
    if config.raw["monitoring"]["scrapeAnnotations"]:
        annotations.update(
            {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(config.http_port),
                "prometheus.io/path": "/metrics",
            }
        )
    return annotations


#: The pod field each downward-API variable of the agent container carries.
_DOWNWARD_FIELDS = {
    "nodeName": "spec.nodeName",
    "podName": "metadata.name",
    "podUid": "metadata.uid",  # the agent's Lease is owned by its pod
    "advertiseAddress": "status.podIP",
}


def _agent_env() -> list[dict[str, Any]]:
    """The downward-API variables that fill the agent's node-local keys, and the
    pod's namespace."""

    def field_env(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        *(field_env(var, _DOWNWARD_FIELDS[key]) for var, key in files.DOWNWARD_ENV.items()),
        field_env("POD_NAMESPACE", "metadata.namespace"),
    ]


def _agent_container(
    config: PoolConfig, host_mounts: list[dict[str, Any]], scratch_mount: dict[str, Any]
) -> dict[str, Any]:
    """The agent container: its command, ports, probes, resources and mounts."""
    # The ConfigMap is mounted as a directory (never subPath) so that a cacheEpoch
    # bump reaches running agents without a restart.
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": names.CONFIG_MOUNT, "readOnly": True},
        {"name": "curve", "mountPath": names.CURVE_MOUNT, "readOnly": True},
        scratch_mount,
        *host_mounts,
    ]
    return {
        "name": "agent",
        "image": config.image,
        "imagePullPolicy": config.raw["agent"]["imagePullPolicy"],
        "command": ["flexkv-agent"],
        "args": ["run", "--config", f"{names.CONFIG_MOUNT}/{names.CONFIG_KEY}"],
        "ports": agent_pod.container_ports(config),
        "env": _agent_env(),
        "livenessProbe": _probe("/healthz", 10, 3),
        "readinessProbe": _probe("/readyz", config.timings.retry_period, 3),
        "resources": agent_pod.agent_resources(config),
        "securityContext": agent_pod.agent_security_context(config),
        "volumeMounts": mounts,
    }


def _agent_pod_spec(
    pool: PoolIdentity, config: PoolConfig, service_account: str
) -> dict[str, Any]:
    """The agent pods' spec: the init and agent containers, volumes and placement."""
    placement = config.placement
    host = agent_pod.host_dirs(config)
    scratch, scratch_mount = agent_pod.scratch_volume()
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.config_map_name(pool.name)}},
        {"name": "curve", "secret": {"secretName": names.curve_secret_name(pool.name)}},
        scratch,
        *host.volumes,
    ]
    return {
        "serviceAccountName": service_account,
        "hostIPC": True,  # CUDA IPC handles between engine pods and the agent
        "terminationGracePeriodSeconds": 30,
        "securityContext": agent_pod.pod_security_context(),
        "initContainers": [agent_pod.chown_init_container(config, host)],
        "containers": [_agent_container(config, host.mounts, scratch_mount)],
        "volumes": volumes,
        "nodeSelector": placement.get("nodeSelector") or None,
        "tolerations": placement.get("tolerations") or None,
        "affinity": placement.get("affinity") or None,
        "priorityClassName": config.raw["agent"].get("priorityClassName") or None,
    }


def render_daemon_set(
    pool: PoolIdentity, config: PoolConfig, service_account: str
) -> dict[str, Any]:
    """The agents' DaemonSet: one agent pod per matching node, rolled one at a time
    (``agent.maxUnavailable``) when the rendering changes."""
    return _stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": _meta(pool, names.agent_name(pool.name)),
            "spec": {
                "selector": {"matchLabels": names.selector_labels(pool.name)},
                "updateStrategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxUnavailable": config.raw["agent"]["maxUnavailable"]},
                },
                "template": {
                    "metadata": {
                        "labels": names.common_labels(pool.name),
                        "annotations": _pod_annotations(pool, config),
                    },
                    "spec": _agent_pod_spec(pool, config, service_account),
                },
            },
        }
    )


def render_headless_service(pool: PoolIdentity, config: PoolConfig) -> dict[str, Any]:
    """Headless Service over all agents, for PP fan-out (not-ready agents included)."""
    labels = dict(config.raw["monitoring"].get("serviceLabels") or {})
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(pool, names.headless_service_name(pool.name), labels),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": names.selector_labels(pool.name),
                "ports": [
                    {"name": "http", "port": config.http_port, "targetPort": "http"},
                    {"name": "fanout", "port": config.fanout_port, "targetPort": "fanout"},
                ],
            },
        }
    )


def render_local_service(pool: PoolIdentity, config: PoolConfig) -> dict[str, Any]:
    """Service that routes only to the agent on the caller's own node."""
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(pool, names.local_service_name(pool.name)),
            "spec": {
                "type": "ClusterIP",
                "internalTrafficPolicy": "Local",
                "selector": names.selector_labels(pool.name),
                "ports": [{"name": "http", "port": config.http_port, "targetPort": "http"}],
            },
        }
    )


def render_pdb(pool: PoolIdentity, config: PoolConfig) -> dict[str, Any]:
    return _stamp(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(pool, names.agent_name(pool.name)),
            "spec": {
                "maxUnavailable": config.raw["agent"]["maxUnavailable"],
                "selector": {"matchLabels": names.selector_labels(pool.name)},
            },
        }
    )


def managed_master(pool: PoolIdentity, config: PoolConfig) -> bool:
    """Whether the pool asks the operator to run its mooncake_master."""
    return config.remote is not None and config.remote.managed


def render_master(pool: PoolIdentity, config: PoolConfig) -> list[dict[str, Any]]:
    """The managed mooncake_master's Service and Deployment; empty when not managed."""
    if not managed_master(pool, config):
        return []
    return [
        _stamp(mooncake.render_master_service(pool.name, pool.namespace, pool.owner)),
        _stamp(mooncake.render_master_deployment(pool.name, pool.namespace, pool.owner, config)),
    ]


def render_all(
    pool: PoolIdentity, config: PoolConfig, service_account: str
) -> list[dict[str, Any]]:
    """Every hashed child, ConfigMap first so agents never start without their config,
    the managed master (if any) before the agents that connect to it."""
    return [
        render_config_map(pool, config),
        render_headless_service(pool, config),
        render_local_service(pool, config),
        render_pdb(pool, config),
        *render_master(pool, config),
        render_daemon_set(pool, config, service_account),
    ]


# Children the operator deletes when the pool no longer asks for them:
# (apiVersion, kind, name) of the managed master's objects.
def optional_children(pool: PoolIdentity) -> list[tuple[str, str, str]]:
    name = names.mooncake_master_name(pool.name)
    return [("apps/v1", "Deployment", name), ("v1", "Service", name)]

"""Process-wide state of one operator instance, shared by handlers and reconciles."""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flexkv_operator.events import EventRecorder
from flexkv_operator.group_publisher import GroupCache
from flexkv_operator.kube import ApiError, KubeClient, api_path
from flexkv_operator.membership import LeaseTracker
from flexkv_operator.metrics import OperatorMetrics

logger = logging.getLogger(__name__)

ENV_AGENT_IMAGE = "FLEXKV_AGENT_IMAGE"
ENV_AGENT_SERVICE_ACCOUNT = "FLEXKV_AGENT_SERVICE_ACCOUNT"
ENV_OPERATOR_ID = "FLEXKV_OPERATOR_ID"
ENV_REMOVED_NODE_LEASES = "FLEXKV_REMOVED_NODE_LEASE_DURATIONS"
ENV_LEADER_ELECTION = "FLEXKV_LEADER_ELECTION"
ENV_LEADER_ELECTION_NAMESPACE = "FLEXKV_LEADER_ELECTION_NAMESPACE"


@dataclass(frozen=True)
class OperatorSettings:
    """Operator-wide settings, from the environment by default."""

    identity: str
    default_image: str
    service_account: str
    resync_seconds: float = 30.0
    node_cache_seconds: float = 60.0
    # An agent whose node left the cluster is dropped (and its Lease deleted) once
    # its Lease has been silent for more than this many lease durations.
    removed_node_lease_durations: float = 10.0
    # GET /metrics and /readyz of the operator itself (0: not served).
    metrics_port: int = 0
    # Active/passive replicas (leadership.py): off by default here (tests, a single
    # process); from_env turns it on unless FLEXKV_LEADER_ELECTION=false.
    leader_election: bool = False
    election_namespace: str = ""  # empty: the first served namespace, else "default"
    election_lease: str = "flexkv-operator"
    election_lease_duration: float = 15.0
    election_renew_deadline: float = 10.0
    election_retry_period: float = 2.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        env = dict(os.environ if env is None else env)
        return cls(
            identity=env.get(ENV_OPERATOR_ID) or env.get("POD_NAME") or socket.gethostname(),
            default_image=env.get(ENV_AGENT_IMAGE, ""),
            service_account=env.get(ENV_AGENT_SERVICE_ACCOUNT) or "flexkv-agent",
            removed_node_lease_durations=_positive(env, ENV_REMOVED_NODE_LEASES, 10.0),
            leader_election=env.get(ENV_LEADER_ELECTION, "true").lower()
            not in ("false", "0", "no", "off"),
            election_namespace=env.get(ENV_LEADER_ELECTION_NAMESPACE)
            or env.get("POD_NAMESPACE", ""),
        )


def _positive(env: dict[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be a positive number (default {default})")
    return value


@dataclass
class NodeCache:
    """Cluster nodes, re-listed at most every ``ttl`` seconds; None if unreadable (RBAC)."""

    ttl: float
    clock: Callable[[], float]
    _nodes: list[dict[str, Any]] | None = None
    _at: float | None = None

    async def get(self, client: KubeClient) -> list[dict[str, Any]] | None:
        now = self.clock()
        if self._at is None or now - self._at >= self.ttl:
            try:
                self._nodes = await client.list(api_path("v1", "nodes"))
            except ApiError as exc:
                logger.info("Cannot list nodes; sizing unchecked", extra={"error": str(exc)})
                self._nodes = None
            self._at = now
        return self._nodes


@dataclass
class OperatorContext:
    """Everything a reconcile needs; built once at operator startup."""

    client: KubeClient
    settings: OperatorSettings
    clock: Callable[[], float]
    tracker: LeaseTracker
    nodes: NodeCache
    groups: GroupCache | None = None
    group_names: dict[tuple[str, str], tuple[float, frozenset[str]]] = field(default_factory=dict)
    wall_clock: Callable[[], datetime.datetime] = field(
        default=lambda: datetime.datetime.now(datetime.UTC)
    )
    events: EventRecorder | None = None
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    # One lock per pool around its group election and publication: the controller's
    # failover timer and a full reconcile never publish one pool's groups at once.
    group_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    # Pools whose Leases were listed once: before that the Lease watch may not have
    # delivered them all, and a group must not lose members for that.
    leases_listed: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.events is None:
            self.events = EventRecorder(self.client, self.settings.identity)
        if self.client.on_error is None:
            self.client.on_error = self.metrics.api_error

    @property
    def recorder(self) -> EventRecorder:
        assert self.events is not None  # set in __post_init__
        return self.events

    def group_lock(self, key: tuple[str, str]) -> asyncio.Lock:
        lock = self.group_locks.get(key)
        if lock is None:
            lock = self.group_locks[key] = asyncio.Lock()
        return lock

    @classmethod
    def create(cls, client: KubeClient, settings: OperatorSettings) -> OperatorContext:
        loop = asyncio.get_running_loop()
        return cls(
            client=client,
            settings=settings,
            clock=loop.time,
            tracker=LeaseTracker(clock=loop.time),
            nodes=NodeCache(ttl=settings.node_cache_seconds, clock=loop.time),
            groups=GroupCache(clock=loop.time, ttl=settings.resync_seconds),
        )

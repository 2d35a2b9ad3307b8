"""Agents' heartbeat Leases, judged by the operator's own clock.

Leases follow docs/contracts.md section 2. Expiry is decided client-go style: a
Lease is fresh while the operator has seen its ``renewTime`` (or its
resourceVersion) change within the last ``leaseDurationSeconds`` of the
operator's clock; the holder's timestamps are never compared with that clock.
After an operator restart every Lease counts as just seen, so a dead holder is
declared lost one lease duration later, never earlier.

One pool per node: the Lease name holds only the node, so two pools in one
namespace on one node share (and keep flipping) one Lease, and two pools in
different namespaces collide on the node's engine socket and shared memory.
:meth:`LeaseTracker.overlaps` reports both cases for the pool's status; the
reconcile first forgets every pool it names that no longer exists (a deleted
pool's agent can renew its Lease once more after the operator forgot the pool).
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flexkv_operator import names

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    """One PP group a local engine rank of an agent registered into."""

    replica: str
    pp_rank: int
    pp_size: int


_INT64_MAX = 2**63 - 1


def _count(value: Any) -> bool:
    """A count an annotation may carry: a non-negative int (not a bool) that fits
    the CRD's int64 ``integer``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _INT64_MAX


@dataclass(frozen=True)
class Lookups:
    """The ``flexkv.io/lookups`` annotation: engine lookups over the agent's last
    ``window_seconds`` (docs/contracts.md section 2)."""

    window_seconds: int
    lookup_tokens: int
    hit_tokens: int


def _lookups(annotations: dict[str, str], problems: list[str]) -> Lookups | None:
    raw = _json(annotations, names.ANNOTATION_LOOKUPS, problems)
    if raw is None:
        return None
    fields = ("windowSeconds", "lookupTokens", "hitTokens")
    values = [raw.get(f) if isinstance(raw, dict) else None for f in fields]
    if not all(_count(v) for v in values):
        problems.append(
            f"annotation {names.ANNOTATION_LOOKUPS} needs non-negative integers "
            f"{', '.join(fields)}: {str(raw)[:80]!r}"
        )
        return None
    window, looked_up, hit = (int(v) for v in values)  # type: ignore[arg-type]
    if hit > looked_up:
        problems.append(
            f"annotation {names.ANNOTATION_LOOKUPS} has hitTokens={hit} above "
            f"lookupTokens={looked_up}"
        )
        return None
    return Lookups(window, looked_up, hit)


@dataclass(frozen=True)
class AgentRecord:
    """What an agent's Lease says, parsed; malformed annotations become empty values."""

    namespace: str
    lease: str
    pool: str
    node: str
    pod: str
    http_endpoint: str
    fanout_endpoint: str
    memberships: tuple[Membership, ...]
    tiers: dict[str, dict[str, int]]
    ready: bool
    lookups: Lookups | None
    """Tokens looked up and found over the agent's recent window; None when the
    agent does not report them."""
    cache_epoch: int | None
    lease_duration: int | None
    renew_marker: str
    problems: tuple[str, ...] = ()
    resource_version: str = ""

    def significant(self) -> tuple[Any, ...]:
        """Everything except the heartbeat itself: a change here needs a reconcile."""
        return (
            self.node,
            self.pod,
            self.http_endpoint,
            self.fanout_endpoint,
            self.memberships,
            self.ready,
            self.cache_epoch,
        )


def _json(annotations: dict[str, str], key: str, problems: list[str]) -> Any:
    text = annotations.get(key)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        problems.append(f"annotation {key} is not JSON: {text[:80]!r}")
        return None


def parse_lease(body: dict[str, Any]) -> AgentRecord | None:
    """Parse an agent Lease; None when it is not an agent Lease of some pool."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(names.LABEL_NAME) != names.AGENT_APP or not labels.get(names.LABEL_POOL):
        return None
    annotations = meta.get("annotations") or {}
    spec = body.get("spec") or {}
    problems: list[str] = []
    endpoints = _json(annotations, names.ANNOTATION_ENDPOINTS, problems) or {}
    raw_members = _json(annotations, names.ANNOTATION_MEMBERSHIPS, problems) or []
    memberships: list[Membership] = []
    for entry in raw_members if isinstance(raw_members, list) else []:
        try:
            memberships.append(
                Membership(str(entry["replica"]), int(entry["ppRank"]), int(entry["ppSize"]))
            )
        except (KeyError, TypeError, ValueError):
            problems.append(f"membership entry {entry!r} needs replica, ppRank and ppSize")
    tiers_raw = _json(annotations, names.ANNOTATION_TIERS, problems) or {}
    tiers: dict[str, dict[str, int]] = {}
    if isinstance(tiers_raw, dict):
        for tier, values in tiers_raw.items():
            if isinstance(values, dict):
                tiers[str(tier)] = {
                    k: v for k, v in values.items()
                    if k in ("capacityBytes", "usedBytes") and _count(v)
                }
                dropped = sorted(k for k in ("capacityBytes", "usedBytes")
                                 if k in values and k not in tiers[str(tier)])
                if dropped:
                    problems.append(
                        f"annotation {names.ANNOTATION_TIERS}: {tier}.{', '.join(dropped)} "
                        "must be non-negative integers"
                    )
    epoch_text = annotations.get(names.ANNOTATION_CACHE_EPOCH)
    try:
        cache_epoch = int(epoch_text) if epoch_text is not None else None
    except ValueError:
        problems.append(f"annotation {names.ANNOTATION_CACHE_EPOCH} is not an integer")
        cache_epoch = None
    duration = spec.get("leaseDurationSeconds")
    return AgentRecord(
        namespace=str(meta.get("namespace") or ""),
        lease=str(meta.get("name") or ""),
        pool=str(labels[names.LABEL_POOL]),
        node=str(labels.get(names.LABEL_NODE) or meta.get("name", "")),
        pod=str(spec.get("holderIdentity") or ""),
        http_endpoint=str(endpoints.get("http", "")) if isinstance(endpoints, dict) else "",
        fanout_endpoint=str(endpoints.get("fanout", "")) if isinstance(endpoints, dict) else "",
        memberships=tuple(sorted(memberships, key=lambda m: (m.replica, m.pp_rank))),
        tiers=tiers,
        ready=annotations.get(names.ANNOTATION_READY) == "true",
        lookups=_lookups(annotations, problems),
        cache_epoch=cache_epoch,
        lease_duration=int(duration) if isinstance(duration, int) and duration > 0 else None,
        renew_marker=f"{spec.get('renewTime')}|{meta.get('resourceVersion')}",
        problems=tuple(problems),
        resource_version=str(meta.get("resourceVersion") or ""),
    )


@dataclass
class _Seen:
    record: AgentRecord
    changed_at: float
    changed_wall: datetime.datetime


@dataclass(frozen=True)
class AgentView:
    """An agent as the operator sees it now."""

    record: AgentRecord
    fresh: bool
    expires_at: float
    last_heartbeat: datetime.datetime
    silent_for: float = 0.0  # seconds since the operator last saw the Lease change
    duration: float = 0.0  # the lease duration it was judged with


def removed_agents(
    agents: list[AgentView], node_names: set[str] | None, stale_durations: float
) -> list[AgentView]:
    """Agents of nodes that left the cluster: silent for more than ``stale_durations``
    lease durations and on a node not in ``node_names``. None (nodes unreadable)
    removes nothing: a node is only judged gone when the list says so."""
    if node_names is None:
        return []
    return [
        view
        for view in agents
        if not view.fresh
        and view.silent_for > stale_durations * view.duration
        and view.record.node not in node_names
    ]


@dataclass(frozen=True)
class _Flip:
    old_pool: str
    new_pool: str
    at: float


@dataclass
class LeaseTracker:
    """Remembers when each agent Lease last changed, by the injected clock."""

    clock: Callable[[], float]
    wall_clock: Callable[[], datetime.datetime] = field(
        default=lambda: datetime.datetime.now(datetime.UTC)
    )
    flip_memory: float = 300.0
    _seen: dict[tuple[str, str], _Seen] = field(default_factory=dict)
    _flips: dict[tuple[str, str], _Flip] = field(default_factory=dict)

    def pool_of(self, namespace: str, lease: str) -> str | None:
        """The pool a tracked Lease named last, or None."""
        seen = self._seen.get((namespace, lease))
        return seen.record.pool if seen else None

    def observe(self, body: dict[str, Any]) -> bool:
        """Record a Lease as seen now; return True if a reconcile is needed
        (a new agent, or a change other than the heartbeat itself)."""
        record = parse_lease(body)
        if record is None:
            return False
        key = (record.namespace, record.lease)
        previous = self._seen.get(key)
        if previous is None:
            self._seen[key] = _Seen(record, self.clock(), self.wall_clock())
            return True
        if previous.record.renew_marker != record.renew_marker:
            previous.changed_at = self.clock()
            previous.changed_wall = self.wall_clock()
        significant = previous.record.significant() != record.significant()
        revived = previous.record.pool != record.pool
        if revived:
            self._flips[key] = _Flip(previous.record.pool, record.pool, self.clock())
            logger.warning(
                "Agent Lease changed pool; two pools run on one node",
                extra={
                    "lease": record.lease,
                    "namespace": record.namespace,
                    "node": record.node,
                    "old_pool": previous.record.pool,
                    "new_pool": record.pool,
                },
            )
        previous.record = record
        return significant or revived

    def forget(self, namespace: str, lease: str) -> AgentRecord | None:
        """Drop a deleted Lease; return what it was, so its pool can be reconciled."""
        seen = self._seen.pop((namespace, lease), None)
        self._flips.pop((namespace, lease), None)
        return seen.record if seen else None

    def forget_pool(self, namespace: str, pool: str) -> None:
        """Drop a deleted pool's Leases and every pool flip naming it, so no other pool
        reports an overlap with a pool that no longer exists."""
        for key in [
            k for k, s in self._seen.items() if k[0] == namespace and s.record.pool == pool
        ]:
            del self._seen[key]
        for key in [
            k
            for k, f in self._flips.items()
            if k[0] == namespace and pool in (f.old_pool, f.new_pool)
        ]:
            del self._flips[key]

    def agents(self, namespace: str, pool: str, default_duration: int) -> list[AgentView]:
        """Every known agent of a pool with its freshness now, sorted by node."""
        now = self.clock()
        views = []
        for (ns, _), seen in self._seen.items():
            if ns != namespace or seen.record.pool != pool:
                continue
            duration = seen.record.lease_duration or default_duration
            expires = seen.changed_at + duration
            views.append(
                AgentView(
                    seen.record,
                    now < expires,
                    expires,
                    seen.changed_wall,
                    silent_for=now - seen.changed_at,
                    duration=float(duration),
                )
            )
        return sorted(views, key=lambda v: (v.record.node, v.record.lease))

    def overlapping_pools(self, namespace: str, pool: str) -> set[tuple[str, str]]:
        """``(namespace, pool)`` of every other pool :meth:`overlaps` names for ``pool``.

        The tracker knows pools only from Lease labels: a deleted pool's agent may
        renew its Lease after the operator forgot the pool. Callers check that
        these pools exist and :meth:`forget_pool` those that do not."""
        return {(ns, other) for ns, other, _ in self._overlap_sources(namespace, pool)}

    def overlaps(self, namespace: str, pool: str) -> list[str]:
        """Messages naming every other pool that claims a node of ``pool``: a Lease of
        another namespace on the same node, or a Lease whose pool label flipped
        between ``pool`` and another within the last ``flip_memory`` seconds."""
        return [
            f"Pools {namespace}/{pool} and {ns}/{other} both run an agent on node {node} "
            f"({how}); run one pool per node: give the pools disjoint "
            "spec.placement.nodeSelector"
            for (ns, other, node), how in sorted(self._overlap_sources(namespace, pool).items())
        ]

    def _overlap_sources(self, namespace: str, pool: str) -> dict[tuple[str, str, str], str]:
        """``(namespace, other pool, node)`` -> how the overlap was seen."""
        found: dict[tuple[str, str, str], str] = {}
        mine = {
            s.record.node
            for (ns, _), s in self._seen.items()
            if ns == namespace and s.record.pool == pool
        }
        for (ns, _), seen in self._seen.items():
            other = (ns, seen.record.pool)
            if other != (namespace, pool) and seen.record.node in mine:
                found[(*other, seen.record.node)] = f"Lease {ns}/{seen.record.lease}"
        now = self.clock()
        for (ns, lease), flip in self._flips.items():
            if ns != namespace or now - flip.at >= self.flip_memory:
                continue
            if pool not in (flip.old_pool, flip.new_pool):
                continue
            other_pool = flip.new_pool if flip.old_pool == pool else flip.old_pool
            holder = self._seen.get((ns, lease))
            node = holder.record.node if holder else lease
            found[(ns, other_pool, node)] = f"Lease {ns}/{lease} switches between both pools"
        return found

    def __len__(self) -> int:
        return len(self._seen)

"""Publish one KVCacheGroup per PP group of a pool (docs/contracts.md section 3).

Every status write is a merge patch carrying the ``metadata.resourceVersion``
the decision was made from, so it only lands if nobody wrote in between. A 409
makes the publisher re-read the group and decide again (bounded attempts); a 404
(the group was deleted meanwhile) makes it create the group again.

A group's identity is its exact ``(spec.poolRef, spec.replica)`` pair, which is
never patched: when the object under a group's name holds another pair (two
pairs whose names sanitise alike), that group fails with an error naming both.
A re-created group starts above ``epoch_floor`` (the epoch the pool's status
last recorded for it), so its epoch never decreases.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flexkv_operator import crds, names
from flexkv_operator.conditions import Condition, merge_conditions
from flexkv_operator.group_election import Candidate, Decision, Published, decide
from flexkv_operator.kube import Conflict, KubeClient, NotFound, api_path
from flexkv_operator.membership import AgentView

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 6


@dataclass(frozen=True)
class GroupMember:
    candidate: Candidate
    last_heartbeat: datetime.datetime


@dataclass(frozen=True)
class GroupPlan:
    """What the agents' Leases say about one replica."""

    replica: str
    pp_size: int
    members: tuple[GroupMember, ...]


@dataclass
class GroupOutcome:
    name: str
    replica: str
    epoch: int
    leader: Candidate | None
    members: list[str]
    written: bool
    decision: Decision | None = None
    previous_leader: str | None = None
    attempts: int = 0
    conflicts: int = field(default=0)
    error: str | None = None
    phase: str = ""  # the group's published phase: Pending, Ready or Degraded


@dataclass
class GroupCache:
    """Last known version of each group (from our own reads and writes), per
    ``namespace/name``, trusted for ``ttl`` seconds of ``clock``.

    Deciding from the cache is safe: every write is conditional on the cached
    resourceVersion, so a stale entry costs one 409 and a re-read, never a wrong
    publication. It saves one GET per group per reconcile when nothing changed.
    Only objects just read from or written to the API server are put, so an
    entry expires ``ttl`` seconds after the last real exchange (it never slides)."""

    clock: Callable[[], float]
    ttl: float = 30.0
    _entries: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self._entries.get(key)
        if entry is None or self.clock() - entry[0] >= self.ttl:
            return None
        return entry[1]

    def put(self, key: str, obj: dict[str, Any]) -> None:
        self._entries[key] = (self.clock(), obj)

    def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def forget_pool(self, namespace: str, pool: str) -> None:
        """Drop every entry of ``pool``'s groups (the pool was deleted)."""
        for key, (_, obj) in list(self._entries.items()):
            if key.startswith(f"{namespace}/") and (obj.get("spec") or {}).get("poolRef") == pool:
                del self._entries[key]


def plan_groups(agents: list[AgentView]) -> list[GroupPlan]:
    """Group agents' memberships by replica; one member per (node, ppRank), fresh first."""
    by_replica: dict[str, dict[tuple[str, int], GroupMember]] = {}
    sizes: dict[str, int] = {}
    for view in agents:
        for membership in view.record.memberships:
            key = (view.record.node, membership.pp_rank)
            member = GroupMember(
                Candidate(
                    node=view.record.node,
                    pp_rank=membership.pp_rank,
                    fanout_endpoint=view.record.fanout_endpoint,
                    ready=view.record.ready,
                    fresh=view.fresh,
                ),
                view.last_heartbeat,
            )
            slot = by_replica.setdefault(membership.replica, {})
            if key not in slot or (member.candidate.fresh and not slot[key].candidate.fresh):
                slot[key] = member
            sizes[membership.replica] = max(sizes.get(membership.replica, 1), membership.pp_size)
    return [
        GroupPlan(replica, sizes[replica], tuple(sorted(members.values(), key=_member_order)))
        for replica, members in sorted(by_replica.items())
    ]


def _member_order(member: GroupMember) -> tuple[int, str]:
    return (member.candidate.pp_rank, member.candidate.node)


def _stamp(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_stamp(text: object) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return None


def render_status(
    plan: GroupPlan,
    decision: Decision,
    live_status: dict[str, Any],
    generation: int,
    now: datetime.datetime,
    identity: str,
) -> dict[str, Any]:
    """The full desired status of a group after ``decision``."""
    members = [
        {
            "node": m.candidate.node,
            "ppRank": m.candidate.pp_rank,
            "fanoutEndpoint": m.candidate.fanout_endpoint,
            "ready": m.candidate.ready and m.candidate.fresh,
            "lastHeartbeat": _stamp(m.last_heartbeat),
        }
        for m in plan.members
    ]
    healthy_ranks = {
        m.candidate.pp_rank for m in plan.members if m.candidate.fresh and m.candidate.ready
    }
    complete = healthy_ranks >= set(range(plan.pp_size))
    leader = decision.leader
    if leader is None:
        phase, condition = "Pending", Condition("Ready", False, "NoLeader", "No fresh member")
    elif complete:
        phase = "Ready"
        condition = Condition("Ready", True, "AllStagesReady", f"Leader {leader.node}")
    else:
        missing = sorted(set(range(plan.pp_size)) - healthy_ranks)
        phase = "Degraded"
        condition = Condition(
            "Ready", False, "StagesMissing", f"PP ranks {missing} have no fresh, ready member"
        )
    status: dict[str, Any] = {
        "epoch": decision.epoch,
        "leader": None
        if leader is None
        else {
            "node": leader.node,
            "ppRank": leader.pp_rank,
            "fanoutEndpoint": leader.fanout_endpoint,
        },
        "members": members,
        "memberCount": len(members),
        "phase": phase,
        "observedGeneration": generation,
        "electedBy": identity if decision.changed else live_status.get("electedBy", identity),
        "conditions": merge_conditions(live_status.get("conditions"), [condition], generation, now),
    }
    if decision.failover:
        status["lastFailover"] = _stamp(now)
    elif live_status.get("lastFailover"):
        status["lastFailover"] = live_status["lastFailover"]
    return status


def _comparable(status: dict[str, Any]) -> dict[str, Any]:
    members = [
        {k: v for k, v in m.items() if k != "lastHeartbeat"} for m in status.get("members") or []
    ]
    conditions = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"}
        for c in status.get("conditions") or []
    ]
    rest = {k: v for k, v in status.items() if k not in ("members", "conditions", "electedBy")}
    return {**rest, "leader": status.get("leader"), "members": members, "conditions": conditions}


def needs_write(live: dict[str, Any], desired: dict[str, Any], heartbeat_slack: float) -> bool:
    """True when the status changed beyond heartbeats, or a published heartbeat lags
    the seen one by ``heartbeat_slack`` seconds or more (heartbeats at a bounded rate)."""
    if _comparable(live) != _comparable(desired):
        return True
    published = {
        (m.get("node"), m.get("ppRank")): m.get("lastHeartbeat") for m in live.get("members") or []
    }
    for member in desired.get("members") or []:
        old = _parse_stamp(published.get((member["node"], member["ppRank"])))
        new = _parse_stamp(member["lastHeartbeat"])
        if old is None or new is None or (new - old).total_seconds() >= heartbeat_slack:
            return True
    return False


@dataclass
class _Publication:
    """One group's publication across its attempts: where it lives, and what the
    attempts so far left behind."""

    client: KubeClient
    pool_body: dict[str, Any]
    plan: GroupPlan
    cache: GroupCache | None
    epoch_floor: int
    conflicts: int = 0
    # A leader change written but answered with an error (a lost reply; the retried
    # conditional write then gets 409): the re-read shows it published, and the
    # outcome must still say so, so that its Event is posted.
    attempted: GroupOutcome | None = None

    @property
    def namespace(self) -> str:
        return str(self.pool_body["metadata"]["namespace"])

    @property
    def pool(self) -> str:
        return str(self.pool_body["metadata"]["name"])

    @property
    def name(self) -> str:
        return names.group_name(self.pool, self.plan.replica)

    @property
    def path(self) -> str:
        return api_path(crds.API_VERSION, crds.GROUP_PLURAL, self.namespace, self.name)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def forget(self) -> None:
        """Drop the cached version: the next attempt reads the group again."""
        if self.cache is not None:
            self.cache.drop(self.key)

    async def live(self) -> dict[str, Any] | GroupOutcome | None:
        """The group as it is now: cached, read, or created; its ``spec.ppSize``
        brought to the plan's. A :class:`GroupOutcome` when the name belongs to
        another ``(poolRef, replica)`` pair; None when the next attempt must retry
        (created or deleted meanwhile)."""
        live = self.cache.get(self.key) if self.cache is not None else None
        fetched = live is None
        if live is None:
            live = await self.client.get_or_none(self.path)
        if live is None:
            try:
                live = await self.client.create(
                    api_path(crds.API_VERSION, crds.GROUP_PLURAL, self.namespace), self._body()
                )
            except Conflict:
                self.conflicts += 1
                return None
        else:
            live_spec = live.get("spec") or {}
            owner = (live_spec.get("poolRef"), live_spec.get("replica"))
            if owner != (self.pool, self.plan.replica):
                self.forget()
                return _collision(self.name, self.namespace, self.plan, owner, self.pool)
            if live_spec.get("ppSize") != self.plan.pp_size:
                try:
                    live = await self.client.patch(
                        self.path, {"spec": {"ppSize": self.plan.pp_size}}
                    )
                except NotFound:
                    self.forget()
                    return None
                fetched = True
        if self.cache is not None and fetched:
            self.cache.put(self.key, live)
        return live

    def _body(self) -> dict[str, Any]:
        """A new group of the plan's replica, owned by the pool."""
        return {
            "apiVersion": crds.API_VERSION,
            "kind": crds.GROUP_KIND,
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {names.LABEL_POOL: self.pool, names.LABEL_MANAGED_BY: names.MANAGER},
                "ownerReferences": [names.owner_reference(self.pool_body)],
            },
            "spec": {
                "poolRef": self.pool,
                "replica": self.plan.replica,
                "ppSize": self.plan.pp_size,
            },
        }

    def landed(self, published: Published, live_status: dict[str, Any], identity: str) -> bool:
        """True when the status shows the leader change of an attempt whose reply was
        lost: the same epoch and leader, elected by this operator."""
        attempted = self.attempted
        return (
            attempted is not None
            and attempted.decision is not None
            and published.epoch == attempted.epoch
            and published.leader_node == (attempted.leader.node if attempted.leader else None)
            and live_status.get("electedBy") == identity
        )

    async def write(
        self, live: dict[str, Any], status: dict[str, Any], outcome: GroupOutcome,
        published: Published,
    ) -> bool:
        """Write ``status`` conditionally on the version ``live`` was read at; False when
        the next attempt must decide again (the group changed or was deleted)."""
        patch = {
            "metadata": {"resourceVersion": live["metadata"]["resourceVersion"]},
            "status": status,
        }
        try:
            written = await self.client.patch(f"{self.path}/status", patch)
        except Conflict:
            self.conflicts += 1
            decision = outcome.decision
            self.attempted = outcome if decision is not None and decision.changed else None
            self.forget()
            logger.info(
                "Group changed while deciding; re-reading",
                extra={"group": self.name, "namespace": self.namespace,
                       "attempt": outcome.attempts},
            )
            return False
        except NotFound:
            self.forget()
            logger.info(
                "Group deleted while deciding; creating it again",
                extra={"group": self.name, "namespace": self.namespace,
                       "epoch_floor": outcome.epoch},
            )
            self.epoch_floor = max(self.epoch_floor, published.epoch)
            return False
        if self.cache is not None:
            self.cache.put(self.key, written)
        outcome.written = True
        return True


def _published(live_status: dict[str, Any], epoch_floor: int) -> Published:
    """What the live status publishes, its epoch raised to at least ``epoch_floor``."""
    leader = live_status.get("leader") or {}
    return Published(
        epoch=max(int(live_status.get("epoch") or 0), epoch_floor),
        leader_node=leader.get("node"),
        leader_rank=leader.get("ppRank"),
    )


async def publish_group(
    client: KubeClient,
    *,
    pool_body: dict[str, Any],
    plan: GroupPlan,
    identity: str,
    heartbeat_slack: float,
    now: datetime.datetime,
    cache: GroupCache | None = None,
    epoch_floor: int = 0,
) -> GroupOutcome:
    """Create the group if needed, decide its leader from the live status, write it back
    conditionally; retries on 409 with a fresh read and on 404 by creating it again.

    Returns an outcome with ``error`` set (and nothing written) when the object under
    the group's name belongs to another ``(poolRef, replica)`` pair."""
    run = _Publication(client, pool_body, plan, cache, epoch_floor)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        live = await run.live()
        if live is None:
            continue
        if isinstance(live, GroupOutcome):
            return live
        live_status = live.get("status") or {}
        published = _published(live_status, run.epoch_floor)
        if run.attempted is not None and run.landed(published, live_status, identity):
            logger.info(
                "Group write landed although its reply was lost",
                extra={"group": run.name, "namespace": run.namespace,
                       "epoch": run.attempted.epoch},
            )
            run.attempted.written = True
            run.attempted.attempts = attempt
            run.attempted.conflicts = run.conflicts
            return run.attempted
        decision = decide(published, [m.candidate for m in plan.members])
        generation = int((live.get("metadata") or {}).get("generation") or 1)
        status = render_status(plan, decision, live_status, generation, now, identity)
        outcome = GroupOutcome(
            name=run.name,
            replica=plan.replica,
            epoch=decision.epoch,
            leader=decision.leader,
            members=[f"{m.candidate.node}/{m.candidate.pp_rank}" for m in plan.members],
            written=False,
            decision=decision,
            previous_leader=published.leader_node,
            attempts=attempt,
            conflicts=run.conflicts,
            phase=str(status["phase"]),
        )
        if not decision.changed and not needs_write(live_status, status, heartbeat_slack):
            return outcome
        if await run.write(live, status, outcome, published):
            return outcome
    raise RuntimeError(
        f"KVCacheGroup {run.namespace}/{run.name}: {MAX_ATTEMPTS} conditional writes "
        "conflicted; another writer keeps changing it, will retry on the next reconcile"
    )


def _collision(
    name: str, namespace: str, plan: GroupPlan, owner: tuple[object, object], pool: str
) -> GroupOutcome:
    message = (
        f"KVCacheGroup {namespace}/{name} belongs to poolRef={owner[0]!r} replica={owner[1]!r}, "
        f"but poolRef={pool!r} replica={plan.replica!r} maps to the same name; rename one "
        "replica (or pool) so that their lowercased, '-'-joined names differ"
    )
    logger.warning(
        "Group name taken by another replica",
        extra={"group": name, "namespace": namespace, "replica": plan.replica, "pool": pool},
    )
    return GroupOutcome(
        name=name,
        replica=plan.replica,
        epoch=0,
        leader=None,
        members=[f"{m.candidate.node}/{m.candidate.pp_rank}" for m in plan.members],
        written=False,
        error=message,
    )

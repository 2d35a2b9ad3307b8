"""One level-based, idempotent reconcile of a KVCachePool.

Reads the pool (as last seen by the watch), the agents' Leases (as tracked), the
DaemonSet and nodes; converges children, groups and status; returns when the
pool should be looked at again. Running it twice changes nothing the second time
(except heartbeat timestamps).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from flexkv_operator import crds, names
from flexkv_operator.apply import ApplyResult, apply_child, ensure_curve_secret, remove_child
from flexkv_operator.children import PoolIdentity, config_hash, optional_children, render_all
from flexkv_operator.conditions import condition_status
from flexkv_operator.context import OperatorContext
from flexkv_operator.events import NORMAL, WARNING
from flexkv_operator.group_election import Decision
from flexkv_operator.group_publisher import GroupCache, GroupOutcome, plan_groups, publish_group
from flexkv_operator.kube import ApiError, Conflict, KubeClient, NotFound, api_path
from flexkv_operator.membership import AgentView, removed_agents
from flexkv_operator.sizing import matching_nodes, sizing_condition
from flexkv_operator.spec import (
    ConfigInvalid,
    PoolConfig,
    Timings,
    election_timings,
    parse_pool_spec,
)
from flexkv_operator.status import invalid_status, pool_status

logger = logging.getLogger(__name__)

GROUP_CONCURRENCY = 16


@dataclass(frozen=True)
class ReconcileResult:
    phase: str
    next_in: float
    children_changed: int
    groups_written: int
    # What the API server refused (one line per child, with its message): the pool is
    # Degraded/ReconcileError and the controller retries with backoff.
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupSync:
    """One pass of a pool's group election and publication."""

    agents: list[AgentView]
    outcomes: list[GroupOutcome]
    next_in: float  # until the earliest fresh agent's Lease expires (capped at the resync)
    # Agents' freshness and groups' leaders: when it changes the pool status is stale.
    signature: tuple[object, ...] = ()


def _pool_path(namespace: str, name: str, sub: str | None = None) -> str:
    return api_path(crds.API_VERSION, crds.POOL_PLURAL, namespace, name, sub)


async def _write_status(client: KubeClient, body: dict[str, Any], status: dict[str, Any]) -> bool:
    """Patch the pool's status; False when the pool vanished meanwhile."""
    meta = body["metadata"]
    try:
        await client.patch(
            _pool_path(meta["namespace"], meta["name"], "status"), {"status": status}
        )
    except NotFound:
        logger.info("Pool vanished before its status was written", extra={"pool": meta["name"]})
        return False
    return True


async def _reject(
    ctx: OperatorContext, body: dict[str, Any], error: ConfigInvalid
) -> ReconcileResult:
    previous = body.get("status") or {}
    generation = int(body["metadata"].get("generation") or 1)
    message = str(error)
    already = (
        condition_status(previous.get("conditions"), "ConfigValid") == "False"
        and previous.get("observedGeneration") == generation
    )
    if not already:
        logger.warning(
            "Pool spec is invalid; children left unchanged",
            extra={"pool": body["metadata"]["name"], "problems": message},
        )
        await ctx.recorder.post(body, WARNING, "ConfigError", message)
    await _write_status(
        ctx.client, body, invalid_status(previous, generation, message, ctx.wall_clock())
    )
    return ReconcileResult("Invalid", ctx.settings.resync_seconds, 0, 0)


def _rollout(ds: dict[str, Any], changed: bool) -> tuple[bool, int | None]:
    """(rollout done, desiredNumberScheduled) from a live DaemonSet's status. A
    DaemonSet whose controller has not reported on its current generation yet is
    still rolling out."""
    status = ds.get("status") or {}
    desired = status.get("desiredNumberScheduled")
    generation = (ds.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    current = observed is not None and (generation is None or observed >= generation)
    done = (
        current
        and not changed
        and desired is not None
        and status.get("updatedNumberScheduled", desired) >= desired
        and status.get("numberUnavailable", 0) == 0
    )
    return (bool(done), None if desired is None else int(desired))


async def _publish_groups(
    ctx: OperatorContext, body: dict[str, Any], timings: Timings, agents: list[Any]
) -> list[GroupOutcome]:
    """Publish every group the agents' Leases name, announce each leader change, and
    delete the pool's groups that no Lease names any more (when due)."""
    plans = plan_groups(agents)
    semaphore = asyncio.Semaphore(GROUP_CONCURRENCY)
    now = ctx.wall_clock()
    floors = epoch_floors(body.get("status") or {})

    async def one(plan: Any) -> GroupOutcome:
        async with semaphore:
            return await publish_group(
                ctx.client,
                pool_body=body,
                plan=plan,
                identity=ctx.settings.identity,
                heartbeat_slack=float(timings.renew_deadline),
                now=now,
                cache=ctx.groups,
                epoch_floor=floors.get(names.group_name(body["metadata"]["name"], plan.replica), 0),
            )

    outcomes = list(await asyncio.gather(*(one(p) for p in plans)))
    for outcome in outcomes:
        decision = outcome.decision
        if outcome.written and decision is not None and decision.changed:
            await _announce_leader_change(ctx, body, agents, outcome, decision)
    await _delete_stale_groups_when_due(ctx, body, outcomes)
    return outcomes


async def _announce_leader_change(
    ctx: OperatorContext,
    body: dict[str, Any],
    agents: list[Any],
    outcome: GroupOutcome,
    decision: Decision,
) -> None:
    """Log a published leader change and post its Event on the group (and, for a
    failover, on the pool); a failover also observes how long the group was without
    its lost leader."""
    group_ref = {
        "apiVersion": crds.API_VERSION,
        "kind": crds.GROUP_KIND,
        "metadata": {"name": outcome.name, "namespace": body["metadata"]["namespace"]},
    }
    leader = decision.leader.node if decision.leader else "none"
    if decision.failover and decision.leader is not None:
        lost = next(
            (v for v in agents if v.record.node == outcome.previous_leader and not v.fresh),
            None,
        )
        if lost is not None:
            ctx.metrics.failover_seconds.observe(max(0.0, ctx.clock() - lost.expires_at))
    if decision.failover:
        reason, kind = "Failover", WARNING
        message = (
            f"Leader {outcome.previous_leader} lost its heartbeat; new leader {leader} "
            f"at epoch {decision.epoch}"
        )
    else:
        reason, kind = "LeaderElected", NORMAL
        message = f"Leader {leader} elected at epoch {decision.epoch}"
    logger.info(
        "Group leader changed",
        extra={"group": outcome.name, "leader": leader, "epoch": decision.epoch, "reason": reason},
    )
    await ctx.recorder.post(group_ref, kind, reason, message)
    if decision.failover:
        await ctx.recorder.post(body, kind, reason, f"{outcome.name}: {message}")


async def _delete_stale_groups_when_due(
    ctx: OperatorContext, body: dict[str, Any], outcomes: list[GroupOutcome]
) -> None:
    """Look for groups to delete when the set of groups changed, and at every resync."""
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    current = frozenset(o.name for o in outcomes)
    checked = ctx.group_names.get(key)
    if (
        checked is None
        or checked[1] != current
        or ctx.clock() - checked[0] >= ctx.settings.resync_seconds
    ):
        await _delete_stale_groups(ctx.client, body, set(current), ctx.groups)
        ctx.group_names[key] = (ctx.clock(), current)


def epoch_floors(status: dict[str, Any]) -> dict[str, int]:
    """Per group name, the epoch the pool's status last recorded: a group created
    again (deleted by hand, or by garbage collection) starts above it."""
    floors: dict[str, int] = {}
    for entry in status.get("groups") or []:
        if isinstance(entry, dict) and isinstance(entry.get("epoch"), int):
            floors[str(entry.get("name"))] = int(entry["epoch"])
    return floors


async def _delete_stale_groups(
    client: KubeClient, body: dict[str, Any], keep: set[str], cache: GroupCache | None
) -> None:
    """Delete this pool's groups that no agent Lease mentions any more."""
    meta = body["metadata"]
    path = api_path(crds.API_VERSION, crds.GROUP_PLURAL, meta["namespace"])
    for group in await client.list(path, {names.LABEL_POOL: meta["name"]}):
        name = group["metadata"]["name"]
        if name not in keep and (group.get("spec") or {}).get("poolRef") == meta["name"]:
            logger.info("Deleting group without members", extra={"group": name})
            if cache is not None:
                cache.drop(f"{meta['namespace']}/{name}")
            await client.delete(
                api_path(crds.API_VERSION, crds.GROUP_PLURAL, meta["namespace"], name)
            )


async def _drop_removed_nodes(
    ctx: OperatorContext,
    body: dict[str, Any],
    nodes: list[dict[str, Any]] | None,
    agents: list[AgentView],
) -> list[AgentView]:
    """``agents`` without those of nodes that left the cluster; their Leases are deleted
    (conditional on the resourceVersion seen, so a renewal in between keeps it)."""
    node_names = (
        None if nodes is None else {str((n.get("metadata") or {}).get("name")) for n in nodes}
    )
    gone = []
    for view in removed_agents(agents, node_names, ctx.settings.removed_node_lease_durations):
        record = view.record
        try:
            await ctx.client.delete(
                api_path("coordination.k8s.io/v1", "leases", record.namespace, record.lease),
                resource_version=record.resource_version or None,
            )
        except Conflict:
            continue  # renewed meanwhile: the watch brings the new version
        gone.append(view)
        logger.info(
            "Forgetting the agent of a removed node",
            extra={
                "node": record.node,
                "lease": record.lease,
                "namespace": record.namespace,
                "silent_seconds": round(view.silent_for, 1),
            },
        )
        ctx.tracker.forget(record.namespace, record.lease)
        await ctx.recorder.post(
            body,
            NORMAL,
            "AgentRemoved",
            f"Node {record.node} left the cluster; its agent (Lease {record.lease}, silent "
            f"{round(view.silent_for)} s) was dropped from the pool and its groups",
        )
    return [v for v in agents if v not in gone]


# (condition type, status, reason or None for any) that deserve a Warning Event when a
# pool enters them, with the Event's reason.
_WARN_ON = (
    ("Degraded", "True", "PoolsOverlap", "PoolsOverlap"),
    ("SizingValid", "False", None, "SizingInvalid"),
)


async def _condition_events(
    ctx: OperatorContext, body: dict[str, Any], previous: dict[str, Any], status: dict[str, Any]
) -> None:
    """A Warning Event when the pool enters an overlap or an invalid sizing (or its
    message changes): once per change, not once per reconcile."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    for condition in status.get("conditions") or []:
        for type_, value, reason, event_reason in _WARN_ON:
            if condition["type"] != type_ or condition["status"] != value:
                continue
            if reason is not None and condition["reason"] != reason:
                continue
            old = before.get(type_) or {}
            if (old.get("status"), old.get("reason"), old.get("message")) == (
                condition["status"],
                condition["reason"],
                condition["message"],
            ):
                continue
            await ctx.recorder.post(body, WARNING, event_reason, str(condition["message"]))


class PoolGone(Exception):
    """The pool no longer exists (or is being deleted): forget it, create nothing."""


async def live_overlaps(ctx: OperatorContext, namespace: str, pool: str) -> list[str]:
    """:meth:`LeaseTracker.overlaps` of ``pool``, naming only pools that exist.

    The tracker learns pools from Lease labels, and a deleted pool's agent can
    renew its node Lease once more after the operator forgot the pool (then a
    new pool's agent taking the Lease over looks like a pool flip). Every pool
    an overlap would name is read first; one that is gone (or being deleted) is
    forgotten, Leases and flips with it. A pool that cannot be read (another
    error than 404) is taken as existing."""
    for other_ns, other in sorted(ctx.tracker.overlapping_pools(namespace, pool)):
        try:
            live = await ctx.client.get_or_none(_pool_path(other_ns, other))
        except ApiError as exc:
            logger.info(
                "Cannot read a pool that overlaps; reporting the overlap",
                extra={"namespace": namespace, "pool": pool, "other": f"{other_ns}/{other}",
                       "error": str(exc)},
            )
            continue
        if live is None or (live.get("metadata") or {}).get("deletionTimestamp"):
            logger.info(
                "Forgetting the Leases of a pool that no longer exists",
                extra={"namespace": other_ns, "pool": other, "overlapping": pool},
            )
            ctx.tracker.forget_pool(other_ns, other)
    return ctx.tracker.overlaps(namespace, pool)


async def refresh_leases(ctx: OperatorContext, namespace: str, pool: str) -> None:
    """Re-read the pool's agent Leases into the tracker. Used after the API server
    failed a group pass: the watch may have missed renewals meanwhile, and an agent
    must not be judged lost for an outage of the API server."""
    path = api_path("coordination.k8s.io/v1", "leases", namespace)
    labels = {names.LABEL_NAME: names.AGENT_APP, names.LABEL_POOL: pool}
    for lease in await ctx.client.list(path, labels):
        ctx.tracker.observe(lease)


async def sync_groups(
    ctx: OperatorContext,
    body: dict[str, Any],
    timings: Timings | None = None,
    *,
    relist: bool = False,
    agents: list[AgentView] | None = None,
) -> GroupSync:
    """Elect and publish every group of the pool ``body`` from the tracked Leases.

    Needs nothing from the pool but its name, its status' epoch floors and its
    election timings (``timings``, else read leniently from the spec), so an invalid
    spec or a child the API server refuses never stops a failover. Runs under the
    pool's group lock; ``relist`` (and the first pass of a pool) re-reads the pool's
    Leases first."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    timings = timings or election_timings(body.get("spec"))
    async with ctx.group_lock((namespace, name)):
        if relist or (namespace, name) not in ctx.leases_listed:
            await refresh_leases(ctx, namespace, name)
            ctx.leases_listed.add((namespace, name))
        if agents is None:
            agents = ctx.tracker.agents(namespace, name, timings.lease_duration)
        outcomes = await _publish_groups(ctx, body, timings, agents)
    now = ctx.clock()
    upcoming = [v.expires_at - now for v in agents if v.fresh]
    signature = (
        tuple((v.record.node, v.fresh) for v in agents),
        tuple((o.name, o.leader.node if o.leader else None, o.epoch) for o in outcomes),
    )
    next_in = max(min([ctx.settings.resync_seconds, *upcoming]), 0.05)
    return GroupSync(agents, outcomes, next_in, signature)


async def _apply_children(
    ctx: OperatorContext, pool: PoolIdentity, manifests: list[dict[str, Any]]
) -> tuple[list[ApplyResult], list[str]]:
    """Apply every child; one refused by the API server is reported (kind, name and the
    server's message) and the others are still applied."""
    results: list[ApplyResult] = []
    errors: list[str] = []
    try:
        await ensure_curve_secret(ctx.client, pool)
    except ApiError as exc:
        errors.append(f"Secret {pool.name}-curve: {exc.status} {exc.message or exc}")
    for manifest in manifests:
        try:
            results.append(await apply_child(ctx.client, manifest))
        except ApiError as exc:
            errors.append(
                f"{manifest['kind']} {manifest['metadata']['name']}: "
                f"{exc.status} {exc.message or exc}"
            )
    rendered = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    for api_version, kind, child in optional_children(pool):
        if (kind, child) in rendered:
            continue
        try:
            removed = await remove_child(ctx.client, pool, api_version, kind, child)
        except ApiError as exc:
            errors.append(f"{kind} {child}: {exc.status} {exc.message or exc}")
            continue
        if removed is not None:
            results.append(removed)
    return results, errors


@dataclass(frozen=True)
class _Children:
    """What applying a pool's children did."""

    results: list[ApplyResult]
    errors: list[str]
    """What the API server refused, one line per child."""
    changed: list[ApplyResult]
    rollout_done: bool
    scheduled: int | None
    """The DaemonSet's desiredNumberScheduled, when it reports one."""


async def _current_pool(ctx: OperatorContext, seen: dict[str, Any]) -> dict[str, Any]:
    """The pool as the API server has it now; :class:`PoolGone` when it was deleted
    (or is being deleted) since the watch delivered ``seen``."""
    meta = seen["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    body = await ctx.client.get_or_none(_pool_path(namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        raise PoolGone(f"KVCachePool {namespace}/{name} is gone")
    return body


async def _converge_children(
    ctx: OperatorContext, body: dict[str, Any], pool: PoolIdentity, config: PoolConfig
) -> _Children:
    """Apply the rendered children, log what changed, post an Event for each child
    changed outside the spec, and read the agents' rollout from the DaemonSet."""
    results, errors = await _apply_children(
        ctx, pool, render_all(pool, config, ctx.settings.service_account)
    )
    changed = [r for r in results if r.action != "unchanged"]
    for result in changed:
        logger.info(
            "Child applied",
            extra={
                "pool": pool.name,
                "kind": result.kind,
                "child": result.name,
                "action": result.action,
            },
        )
    for result in changed:
        if result.action == "corrected":
            await ctx.recorder.post(
                body,
                WARNING,
                "DriftCorrected",
                f"{result.kind} {result.name} was changed outside the pool's spec "
                f"({', '.join(result.drift[:5])}); reverted to the rendering. Change the "
                "KVCachePool instead",
            )
    ds = next((r for r in results if r.kind == "DaemonSet"), None)
    if ds is None:
        rollout_done, scheduled = False, None
    else:
        rollout_done, scheduled = _rollout(ds.live, ds.action != "unchanged")
    return _Children(results, errors, changed, rollout_done, scheduled)


async def _known_agents(
    ctx: OperatorContext,
    body: dict[str, Any],
    nodes: list[dict[str, Any]] | None,
    config: PoolConfig,
) -> list[AgentView]:
    """The pool's agents from their Leases (listed first on the pool's first pass),
    without those of nodes that left the cluster."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if (namespace, name) not in ctx.leases_listed:
        async with ctx.group_lock((namespace, name)):
            await refresh_leases(ctx, namespace, name)
            ctx.leases_listed.add((namespace, name))
    return await _drop_removed_nodes(
        ctx, body, nodes, ctx.tracker.agents(namespace, name, config.timings.lease_duration)
    )


def _desired_agents(
    scheduled: int | None,
    nodes: list[dict[str, Any]] | None,
    agents: list[AgentView],
    config: PoolConfig,
) -> int:
    """How many agents the pool should have: the DaemonSet's count, else the nodes
    that match its placement, else (nodes unreadable) the agents known."""
    if scheduled is not None:
        return scheduled
    if nodes is not None:
        return len(matching_nodes(nodes, config))
    return len(agents)


async def _report(
    ctx: OperatorContext,
    body: dict[str, Any],
    previous: dict[str, Any],
    config: PoolConfig,
    errors: list[str],
) -> None:
    """Warn about refused children, and post a CacheFlush Event when the pool's
    cacheEpoch changed since the last status."""
    if errors:
        logger.warning(
            "The API server refused children of the pool",
            extra={
                "pool": body["metadata"]["name"],
                "namespace": body["metadata"]["namespace"],
                "errors": errors,
            },
        )
        await ctx.recorder.post(body, WARNING, "ReconcileError", "; ".join(errors))
    if previous.get("cacheEpoch") is not None and previous.get("cacheEpoch") != config.cache_epoch:
        await ctx.recorder.post(
            body,
            NORMAL,
            "CacheFlush",
            f"cacheEpoch {previous.get('cacheEpoch')} -> {config.cache_epoch} published to agents",
        )


async def reconcile_pool(ctx: OperatorContext, seen: dict[str, Any]) -> ReconcileResult:
    """Converge one pool; see the module docstring.

    ``seen`` is the pool as the watch last delivered it; the reconcile re-reads it
    first, so it acts on the current spec and status and never recreates children
    of a pool deleted meanwhile (raises :class:`PoolGone`). Groups are published
    whatever the spec and the children's outcome."""
    body = await _current_pool(ctx, seen)
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        config = parse_pool_spec(body.get("spec"), ctx.settings.default_image, name=name)
    except ConfigInvalid as error:
        await sync_groups(ctx, body, election_timings(body.get("spec")))
        return await _reject(ctx, body, error)
    pool = PoolIdentity(name, namespace, names.owner_reference(body))
    children = await _converge_children(ctx, body, pool, config)
    nodes = await ctx.nodes.get(ctx.client)
    agents = await _known_agents(ctx, body, nodes, config)
    desired = _desired_agents(children.scheduled, nodes, agents, config)
    groups = (await sync_groups(ctx, body, config.timings, agents=agents)).outcomes
    previous = body.get("status") or {}
    await _report(ctx, body, previous, config, children.errors)
    status = pool_status(
        previous=previous,
        generation=int(body["metadata"].get("generation") or 1),
        desired_agents=desired,
        agents=agents,
        groups=groups,
        children_current=not children.errors,
        rollout_done=children.rollout_done,
        cache_epoch=config.cache_epoch,
        config_hash=config_hash(pool, config),
        sizing=sizing_condition(nodes, config),
        now=ctx.wall_clock(),
        overlaps=await live_overlaps(ctx, namespace, name),
        reconcile_errors=children.errors,
    )
    # A pool deleted during its reconcile gets no status and no Event: its overlap
    # with the pool that replaced it on its nodes is not news.
    if status != previous and await _write_status(ctx.client, body, status):
        await _condition_events(ctx, body, previous, status)
    # Lease expiries are the controller's failover timer's job (sync_groups); a full
    # reconcile is due at the resync, or every retry period during a rollout.
    next_in = ctx.settings.resync_seconds
    if not children.rollout_done:
        next_in = min(next_in, float(config.timings.retry_period))
    return ReconcileResult(
        status["phase"],
        max(next_in, 0.05),
        len(children.changed),
        sum(o.written for o in groups),
        tuple(children.errors),
    )

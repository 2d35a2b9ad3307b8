"""The KVCachePool status: agents, groups, counts, phase and conditions.

Built from small pure parts: :func:`tally` sorts the agents and groups,
one function per condition decides it from the tally, :func:`pool_phase` derives
the phase from the conditions, and :func:`pool_status` assembles them."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from flexkv_operator.conditions import Condition, merge_conditions
from flexkv_operator.group_publisher import GroupOutcome
from flexkv_operator.membership import AgentView


def agent_entries(agents: list[AgentView]) -> list[dict[str, Any]]:
    """``status.agents``: one entry per known agent, as its heartbeat says."""
    return [
        {
            "node": v.record.node,
            "pod": v.record.pod,
            "endpoint": v.record.http_endpoint,
            "fanoutEndpoint": v.record.fanout_endpoint,
            "ready": v.record.ready and v.fresh,
            "fresh": v.fresh,
            "cacheEpoch": v.record.cache_epoch,
            "lastHeartbeat": v.last_heartbeat.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "tiers": v.record.tiers,
            **({"lookups": {
                "windowSeconds": v.record.lookups.window_seconds,
                "lookupTokens": v.record.lookups.lookup_tokens,
                "hitTokens": v.record.lookups.hit_tokens,
            }} if v.record.lookups is not None else {}),
        }
        for v in agents
    ]


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def cache_summary(agents: list[AgentView]) -> dict[str, Any]:
    """``status.cache``: the pool's hit rate and tier use, summed over the agents
    whose heartbeat is fresh (a lost agent's last report is not counted).

    ``hitRate`` is looked-up tokens found in a cache tier over those looked up, in
    the agents' recent windows (``flexkv.io/lookups``, at most
    ``LOOKUP_WINDOW_SECONDS``); ``-`` when none was looked up or no agent reports
    lookups. Each tier's ``use`` is its used over its capacity bytes. The
    percentages are strings, for ``kubectl get``'s columns."""
    fresh = [v.record for v in agents if v.fresh]
    reported = [r.lookups for r in fresh if r.lookups is not None]
    looked_up = sum(lk.lookup_tokens for lk in reported)
    hit = sum(lk.hit_tokens for lk in reported)
    tiers: dict[str, dict[str, Any]] = {}
    for record in fresh:
        for name, values in record.tiers.items():
            tier = tiers.setdefault(name, {"capacityBytes": 0, "usedBytes": 0})
            tier["capacityBytes"] += values.get("capacityBytes", 0)
            tier["usedBytes"] += values.get("usedBytes", 0)
    for tier in tiers.values():
        tier["use"] = _percent(tier["usedBytes"], tier["capacityBytes"])
    return {
        "lookupTokens": looked_up,
        "hitTokens": hit,
        "hitRate": _percent(hit, looked_up),
        "reportingAgents": len(reported),
        "tiers": dict(sorted(tiers.items())),
    }


def group_entries(outcomes: list[GroupOutcome]) -> list[dict[str, Any]]:
    """``status.groups``: one entry per published group (conflicted ones left out)."""
    return [
        {
            "name": o.name,
            "replica": o.replica,
            "leader": o.leader.node if o.leader else None,
            "epoch": o.epoch,
            "members": o.members,
        }
        for o in outcomes
        if o.error is None
    ]


@dataclass(frozen=True)
class Tally:
    """What the agents' heartbeats and the groups' outcomes say, sorted for the
    conditions (each list in the order given)."""

    ready: list[AgentView]
    """Fresh agents that report ready (on any cacheEpoch)."""
    epoch_lag: list[AgentView]
    """Ready agents that report another cacheEpoch than the pool's."""
    lost: list[AgentView]
    """Known agents without a fresh heartbeat."""
    conflicted: list[GroupOutcome]
    """Groups whose name belongs to another replica."""
    published: list[GroupOutcome]
    leaderless: list[GroupOutcome]
    incomplete: list[GroupOutcome]
    """Groups with a leader that miss a fresh, ready member for some PP rank."""

    @property
    def ready_count(self) -> int:
        """Agents fresh, ready and on the pool's cacheEpoch."""
        return len(self.ready) - len(self.epoch_lag)


def tally(agents: list[AgentView], groups: list[GroupOutcome], cache_epoch: int) -> Tally:
    """Sort ``agents`` and ``groups`` into what the conditions report on."""
    ready = [v for v in agents if v.fresh and v.record.ready]
    published = [g for g in groups if g.error is None]
    return Tally(
        ready=ready,
        epoch_lag=[v for v in ready if v.record.cache_epoch not in (None, cache_epoch)],
        lost=[v for v in agents if not v.fresh],
        conflicted=[g for g in groups if g.error is not None],
        published=published,
        leaderless=[g for g in published if g.leader is None],
        incomplete=[g for g in published if g.leader is not None and g.phase == "Degraded"],
    )


def degraded_condition(
    counts: Tally, overlaps: list[str], reconcile_errors: list[str]
) -> Condition:
    """``Degraded``: the first that applies of ReconcileError, PoolsOverlap,
    GroupNameConflict, HeartbeatLost, GroupWithoutLeader and GroupDegraded, else
    False (AllHeartbeatsFresh)."""
    if reconcile_errors:
        return Condition("Degraded", True, "ReconcileError", "; ".join(reconcile_errors[:5]))
    if overlaps:
        return Condition("Degraded", True, "PoolsOverlap", "; ".join(overlaps[:5]))
    if counts.conflicted:
        return Condition(
            "Degraded",
            True,
            "GroupNameConflict",
            "; ".join(str(g.error) for g in counts.conflicted[:5]),
        )
    if counts.lost:
        return Condition(
            "Degraded",
            True,
            "HeartbeatLost",
            f"Agents without fresh heartbeat: {', '.join(v.record.node for v in counts.lost[:10])}",
        )
    if counts.leaderless:
        return Condition(
            "Degraded",
            True,
            "GroupWithoutLeader",
            f"Groups without leader: {', '.join(g.name for g in counts.leaderless[:10])}",
        )
    if counts.incomplete:
        return Condition(
            "Degraded",
            True,
            "GroupDegraded",
            "Groups missing a fresh, ready member for some PP rank: "
            + ", ".join(g.name for g in counts.incomplete[:10]),
        )
    return Condition("Degraded", False, "AllHeartbeatsFresh", "")


def ready_condition(
    counts: Tally,
    *,
    desired_agents: int,
    rollout_done: bool,
    progressing: bool,
    degraded: Condition,
    reconcile_errors: list[str],
) -> Condition:
    """``Ready``: every desired agent fresh, ready and on the current cacheEpoch,
    nothing progressing and not degraded; else False saying what is missing."""
    if reconcile_errors:
        return Condition(
            "Ready", False, "ReconcileError", "The API server refused children of the pool"
        )
    ready_count = counts.ready_count
    all_ready = desired_agents > 0 and ready_count >= desired_agents
    if all_ready and not progressing and not degraded.status:
        return Condition("Ready", True, "AgentsReady", f"{ready_count} agents ready")
    why = []
    if desired_agents == 0:
        why.append("no agent is scheduled yet")
    if ready_count < desired_agents:
        why.append(f"{ready_count}/{desired_agents} agents ready")
    if counts.epoch_lag:
        why.append(f"{len(counts.epoch_lag)} agents still on an older cacheEpoch")
    if not rollout_done:
        why.append("agent rollout in progress")
    if degraded.status:
        why.append(f"degraded: {degraded.reason}")
    return Condition("Ready", False, "AgentsNotReady", "; ".join(why) or "pending")


def progressing_condition(progressing: bool) -> Condition:
    """``Progressing``: children changed or the agents' rollout is not finished."""
    return Condition(
        "Progressing",
        progressing,
        "RollingOut" if progressing else "UpToDate",
        "Children updated or the agents' rollout is not finished" if progressing else "",
    )


def pool_phase(
    *, degraded: Condition, ready: Condition, progressing: bool, nothing_scheduled: bool
) -> str:
    """Degraded if Degraded, else Pending while no agent is scheduled or known, else
    Ready if Ready, else Progressing if Progressing, else Pending (waiting for agents)."""
    if degraded.status:
        return "Degraded"
    if nothing_scheduled:
        return "Pending"  # nothing scheduled and no agent: nothing can progress yet
    if ready.status:
        return "Ready"
    if progressing:
        return "Progressing"
    return "Pending"


def pool_status(
    *,
    previous: dict[str, Any],
    generation: int,
    desired_agents: int,
    agents: list[AgentView],
    groups: list[GroupOutcome],
    children_current: bool,
    rollout_done: bool,
    cache_epoch: int,
    config_hash: str,
    sizing: Condition,
    now: datetime.datetime,
    overlaps: list[str] | None = None,
    reconcile_errors: list[str] | None = None,
) -> dict[str, Any]:
    """Status of a valid pool: counts, agents and groups, and the conditions
    ConfigValid, SizingValid (``sizing``), Ready (:func:`ready_condition`),
    Progressing (children changed or the agents' rollout is not finished, nothing
    else: a lost agent on a rolled-out pool is Degraded, not Progressing) and
    Degraded (:func:`degraded_condition`), with the phase derived from them
    (:func:`pool_phase`)."""
    reconcile_errors = reconcile_errors or []
    counts = tally(agents, groups, cache_epoch)
    progressing = not children_current or not rollout_done
    degraded = degraded_condition(counts, overlaps or [], reconcile_errors)
    ready = ready_condition(
        counts,
        desired_agents=desired_agents,
        rollout_done=rollout_done,
        progressing=progressing,
        degraded=degraded,
        reconcile_errors=reconcile_errors,
    )
    valid = Condition("ConfigValid", True, "Valid", "Spec accepted")
    conditions = merge_conditions(
        previous.get("conditions"),
        [valid, sizing, ready, progressing_condition(progressing), degraded],
        generation,
        now,
    )
    phase = pool_phase(
        degraded=degraded, ready=ready, progressing=progressing,
        nothing_scheduled=desired_agents == 0 and not agents,
    )
    return {
        "observedGeneration": generation,
        "phase": phase,
        "desiredAgents": desired_agents,
        "readyAgents": counts.ready_count,
        "groupCount": len(counts.published),
        "cacheEpoch": cache_epoch,
        "configHash": config_hash,
        "cache": cache_summary(agents),
        "agents": agent_entries(agents),
        "groups": group_entries(groups),
        "conditions": conditions,
    }


def invalid_status(
    previous: dict[str, Any], generation: int, message: str, now: datetime.datetime
) -> dict[str, Any]:
    """Status of a pool whose spec cannot be acted on; other fields are kept as they were."""
    conditions = merge_conditions(
        previous.get("conditions"),
        [
            Condition("ConfigValid", False, "InvalidSpec", message),
            Condition("Ready", False, "InvalidSpec", "Spec is invalid; children left unchanged"),
            Condition("Progressing", False, "InvalidSpec", "Waiting for a valid spec"),
        ],
        generation,
        now,
    )
    return {"observedGeneration": generation, "phase": "Invalid", "conditions": conditions}

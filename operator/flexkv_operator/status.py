"""The KVCachePool status: agents, groups, counts, phase and conditions."""

from __future__ import annotations

import datetime
from typing import Any

from flexkv_operator.conditions import Condition, merge_conditions
from flexkv_operator.group_publisher import GroupOutcome
from flexkv_operator.membership import AgentView


def agent_entries(agents: list[AgentView]) -> list[dict[str, Any]]:
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
        }
        for v in agents
    ]


def group_entries(outcomes: list[GroupOutcome]) -> list[dict[str, Any]]:
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
    """Status of a valid pool; the phase is derived from the conditions.

    * Degraded: the API server refused a child (ReconcileError), another pool claims
      one of this pool's nodes (PoolsOverlap), a group's name belongs to another
      replica (GroupNameConflict), a known agent lost its heartbeat (HeartbeatLost),
      a group has no leader (GroupWithoutLeader) or misses PP stages (GroupDegraded),
      in that order of precedence;
    * Progressing: children changed or the agents' rollout is not finished, nothing
      else (a lost agent on a rolled-out pool is Degraded, not Progressing);
    * Ready: children current, rollout done, every desired agent fresh, ready and on
      the current cacheEpoch, and not Degraded.

    Phase: Degraded if Degraded, else Pending while no agent is scheduled or known,
    else Ready if Ready, else Progressing if Progressing, else Pending (waiting for
    agents)."""
    reconcile_errors = reconcile_errors or []
    ready = [v for v in agents if v.fresh and v.record.ready]
    epoch_lag = [v for v in ready if v.record.cache_epoch not in (None, cache_epoch)]
    lost = [v for v in agents if not v.fresh]
    conflicted = [g for g in groups if g.error is not None]
    published = [g for g in groups if g.error is None]
    leaderless = [g for g in published if g.leader is None]
    incomplete = [g for g in published if g.leader is not None and g.phase == "Degraded"]
    ready_count = len(ready) - len(epoch_lag)
    all_ready = desired_agents > 0 and ready_count >= desired_agents
    progressing = not children_current or not rollout_done
    if reconcile_errors:
        degraded = Condition("Degraded", True, "ReconcileError", "; ".join(reconcile_errors[:5]))
    elif overlaps:
        degraded = Condition("Degraded", True, "PoolsOverlap", "; ".join(overlaps[:5]))
    elif conflicted:
        degraded = Condition(
            "Degraded", True, "GroupNameConflict", "; ".join(str(g.error) for g in conflicted[:5])
        )
    elif lost:
        degraded = Condition(
            "Degraded",
            True,
            "HeartbeatLost",
            f"Agents without fresh heartbeat: {', '.join(v.record.node for v in lost[:10])}",
        )
    elif leaderless:
        degraded = Condition(
            "Degraded",
            True,
            "GroupWithoutLeader",
            f"Groups without leader: {', '.join(g.name for g in leaderless[:10])}",
        )
    elif incomplete:
        degraded = Condition(
            "Degraded",
            True,
            "GroupDegraded",
            "Groups missing a fresh, ready member for some PP rank: "
            + ", ".join(g.name for g in incomplete[:10]),
        )
    else:
        degraded = Condition("Degraded", False, "AllHeartbeatsFresh", "")
    is_degraded = bool(degraded.status)
    if reconcile_errors:
        ready_condition = Condition(
            "Ready", False, "ReconcileError", "The API server refused children of the pool"
        )
    elif all_ready and not progressing and not is_degraded:
        ready_condition = Condition("Ready", True, "AgentsReady", f"{ready_count} agents ready")
    else:
        why = []
        if desired_agents == 0:
            why.append("no agent is scheduled yet")
        if ready_count < desired_agents:
            why.append(f"{ready_count}/{desired_agents} agents ready")
        if epoch_lag:
            why.append(f"{len(epoch_lag)} agents still on an older cacheEpoch")
        if not rollout_done:
            why.append("agent rollout in progress")
        if is_degraded:
            why.append(f"degraded: {degraded.reason}")
        ready_condition = Condition("Ready", False, "AgentsNotReady", "; ".join(why) or "pending")
    progressing_condition = Condition(
        "Progressing",
        progressing,
        "RollingOut" if progressing else "UpToDate",
        "Children updated or the agents' rollout is not finished" if progressing else "",
    )
    conditions = merge_conditions(
        previous.get("conditions"),
        [
            Condition("ConfigValid", True, "Valid", "Spec accepted"),
            sizing,
            ready_condition,
            progressing_condition,
            degraded,
        ],
        generation,
        now,
    )
    if is_degraded:
        phase = "Degraded"
    elif desired_agents == 0 and not agents:
        phase = "Pending"  # nothing scheduled and no agent: nothing can progress yet
    elif ready_condition.status:
        phase = "Ready"
    elif progressing:
        phase = "Progressing"
    else:
        phase = "Pending"
    return {
        "observedGeneration": generation,
        "phase": phase,
        "desiredAgents": desired_agents,
        "readyAgents": ready_count,
        "groupCount": len(published),
        "cacheEpoch": cache_epoch,
        "configHash": config_hash,
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

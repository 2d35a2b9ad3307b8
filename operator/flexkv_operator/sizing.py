"""SizingValid: do the tiers fit the nodes the agents are placed on?

Compares the CPU tier and the remote tier's segment and buffer (plus the agent's
memory request) with each matching node's allocatable memory, the SSD tier
with its allocatable ephemeral storage, and the CPU tier's copy lanes with its
allocatable CPU, where the node reports them. Nodes are matched by the pool's
nodeSelector only (affinity and taints are not evaluated here).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from flexkv_operator.agent_pod import remote_bytes
from flexkv_operator.conditions import Condition
from flexkv_operator.quantity import parse_bytes
from flexkv_operator.spec import PoolConfig
from node_agent.contract.quantity import parse_quantity


@dataclass(frozen=True)
class NodeFit:
    node: str
    problems: tuple[str, ...]


def matching_nodes(nodes: list[dict[str, Any]], config: PoolConfig) -> list[dict[str, Any]]:
    selector = config.placement.get("nodeSelector") or {}
    return [
        n
        for n in nodes
        if all(
            ((n.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items()
        )
    ]


def _allocatable(node: dict[str, Any], key: str) -> int | None:
    value = ((node.get("status") or {}).get("allocatable") or {}).get(key)
    if value is None:
        return None
    try:
        return parse_bytes(value, f"allocatable.{key}")
    except ValueError:
        return None


def _allocatable_cpu(node: dict[str, Any]) -> Decimal | None:
    value = ((node.get("status") or {}).get("allocatable") or {}).get("cpu")
    return None if value is None else parse_quantity(str(value))


def fit(node: dict[str, Any], config: PoolConfig) -> NodeFit:
    name = str((node.get("metadata") or {}).get("name"))
    requests = ((config.raw.get("agent") or {}).get("resources") or {}).get("requests") or {}
    try:
        extra = parse_bytes(requests["memory"], "requests.memory") if "memory" in requests else 0
    except ValueError:
        extra = 0
    problems = []
    memory = _allocatable(node, "memory")
    remote = remote_bytes(config)
    if memory is not None and config.cpu_bytes + remote + extra > memory:
        remote_part = f" + remote segment and buffer {remote} B" if remote else ""
        problems.append(
            f"cpu tier {config.cpu_bytes} B{remote_part} + agent request {extra} B > "
            f"allocatable memory {memory} B"
        )
    storage = _allocatable(node, "ephemeral-storage")
    if config.ssd_bytes and storage is not None and config.ssd_bytes > storage:
        problems.append(
            f"ssd tier {config.ssd_bytes} B > allocatable ephemeral-storage {storage} B"
        )
    cpu = _allocatable_cpu(node)
    if config.copy_lanes is not None and cpu is not None and config.copy_lanes > cpu:
        # More lanes than the node has cores only share those cores (and one more
        # thread per copy costs a little: docs/operator.md).
        problems.append(
            f"tiers.cpu.copyLanes {config.copy_lanes} > allocatable cpu {cpu.normalize():f}")
    return NodeFit(name, tuple(problems))


def sizing_condition(nodes: list[dict[str, Any]] | None, config: PoolConfig) -> Condition:
    """SizingValid from the node list (None when nodes cannot be read)."""
    if nodes is None:
        return Condition(
            "SizingValid", None, "NodesUnknown", "Nodes cannot be read; sizes unchecked"
        )
    if not nodes:
        return Condition("SizingValid", None, "NoNodes", "The cluster lists no nodes yet")
    matched = matching_nodes(nodes, config)
    if not matched:
        return Condition(
            "SizingValid", None, "NoMatchingNodes", "No node matches spec.placement.nodeSelector"
        )
    bad = [f for f in (fit(n, config) for n in matched) if f.problems]
    if not bad:
        return Condition(
            "SizingValid", True, "TiersFit", f"Tiers fit all {len(matched)} matching nodes"
        )
    shown = "; ".join(f"{f.node}: {', '.join(f.problems)}" for f in bad[:5])
    return Condition(
        "SizingValid",
        False,
        "TiersTooLarge",
        f"{len(bad)} of {len(matched)} nodes are too small ({shown}); "
        "lower spec.tiers sizes (or tiers.cpu.copyLanes) or select larger nodes",
    )

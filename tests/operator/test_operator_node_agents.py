"""Agents that outlive their node, and pools that share a node: a Lease silent for
many lease durations on a node that left the cluster is dropped and deleted; two
pools claiming one node make both pools Degraded with PoolsOverlap."""

from __future__ import annotations

import json
from typing import Any

from flexkv_operator import names
from flexkv_operator.membership import LeaseTracker
from flexkv_operator.reconcile import reconcile_pool

from tests.operator.flexkv_harness import FakeAgent, pool_manifest
from tests.operator.reconcile_harness import ManualClock, add_node, reconcile, reconcile_context
from tests.support.kube_api import GROUPS, LEASES, NS, POOLS, ApiServer

LEASE = 3


def degraded(api: ApiServer, pool: str = "pool") -> dict[str, Any]:
    st = (api.stored(POOLS, NS, pool) or {}).get("status") or {}
    return next(c for c in st.get("conditions") or [] if c["type"] == "Degraded")


def agent(api: ApiServer, node: str, rank: int, pool: str = "pool") -> FakeAgent:
    return FakeAgent(
        api, pool, node, [{"replica": "r0", "ppRank": rank, "ppSize": 3}], lease_duration=LEASE
    )


async def test_agent_of_a_removed_node_is_dropped_after_many_lease_durations(
    api: ApiServer,
) -> None:
    await api.create_object(POOLS, pool_manifest())
    for node in ("node-a", "node-b"):
        await add_node(api, node)  # node-gone is not (or no longer) in the cluster
    agents = [agent(api, "node-a", 0), agent(api, "node-b", 1), agent(api, "node-gone", 2)]
    for one in agents:
        await one.start()
    clock = ManualClock()
    async with reconcile_context(api, clock, removed_node_lease_durations=4) as ctx:
        await reconcile(ctx, api)

        async def step(seconds: float) -> None:
            clock.now += seconds
            await agents[0].beat()  # node-a alive; node-b (node exists) and node-gone silent
            await reconcile(ctx, api)

        await step(LEASE * 3)  # silent 3 lease durations: lost, not yet removed
        st = api.stored(POOLS, NS, "pool")["status"]  # type: ignore[index]
        assert {a["node"] for a in st["agents"]} == {"node-a", "node-b", "node-gone"}
        assert degraded(api)["reason"] == "HeartbeatLost"
        assert "node-gone" in api.stored(GROUPS, NS, "pool-r0")["status"]["members"][2]["node"]  # type: ignore[index]

        await step(LEASE * 2)  # silent 5 lease durations > 4
        st = api.stored(POOLS, NS, "pool")["status"]  # type: ignore[index]
        assert {a["node"] for a in st["agents"]} == {"node-a", "node-b"}
        members = api.stored(GROUPS, NS, "pool-r0")["status"]["members"]  # type: ignore[index]
        assert [m["node"] for m in members] == ["node-a", "node-b"]
        assert names.lease_name("node-gone") not in api.names(LEASES, NS)
        assert names.lease_name("node-b") in api.names(LEASES, NS)  # its node still exists
        assert "node-b" in degraded(api)["message"] and "node-gone" not in degraded(api)["message"]
        removed = [
            e
            for e in (api.stored("v1/events", NS, n) or {} for n in api.names("v1/events", NS))
            if e.get("reason") == "AgentRemoved"
        ]
        assert [e["type"] for e in removed] == ["Normal"] and "node-gone" in removed[0]["message"]


async def test_a_renewed_lease_is_not_deleted(api: ApiServer) -> None:
    """The delete is conditional on the resourceVersion the operator judged."""
    await api.create_object(POOLS, pool_manifest())
    gone = agent(api, "node-gone", 0)
    await gone.start()
    clock = ManualClock()
    async with reconcile_context(api, clock, removed_node_lease_durations=1) as ctx:
        await reconcile(ctx, api)
        clock.now += LEASE * 2
        # The agent renews after the operator last saw its Lease and before the
        # delete lands (the watch event has not arrived yet): the delete conflicts.
        await gone.beat()
        await reconcile_pool(ctx, api.stored(POOLS, NS, "pool"))  # type: ignore[arg-type]
        assert names.lease_name("node-gone") in api.names(LEASES, NS)
        assert api.conflicts == 1


async def test_two_pools_sharing_one_lease_are_both_degraded(api: ApiServer) -> None:
    await api.create_object(POOLS, pool_manifest("p1"))
    await api.create_object(POOLS, pool_manifest("p2"))
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await agent(api, "node-a", 0, "p1").start()
        await reconcile(ctx, api, "p1")
        assert degraded(api, "p1")["reason"] != "PoolsOverlap"
        # p2's agent on the same node writes the same Lease name (flexkv-agent-node-a).
        await agent(api, "node-a", 0, "p2").beat()
        clock.now += 1
        await reconcile(ctx, api, "p2")
        await reconcile(ctx, api, "p1")
        for pool, other in (("p1", "p2"), ("p2", "p1")):
            condition = degraded(api, pool)
            assert condition["status"] == "True" and condition["reason"] == "PoolsOverlap"
            assert (
                f"{NS}/{pool}" in condition["message"] and f"{NS}/{other}" in condition["message"]
            )
            assert (
                "node node-a" in condition["message"]
                and "one pool per node" in condition["message"]
            )


def lease_body(namespace: str, pool: str, node: str, version: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": names.lease_name(node),
            "namespace": namespace,
            "resourceVersion": version,
            "labels": {
                names.LABEL_NAME: names.AGENT_APP,
                names.LABEL_POOL: pool,
                names.LABEL_NODE: node,
            },
            "annotations": {names.ANNOTATION_MEMBERSHIPS: json.dumps([])},
        },
        "spec": {"renewTime": version, "leaseDurationSeconds": LEASE},
    }


def test_pools_of_two_namespaces_on_one_node_overlap_and_flips_are_forgotten() -> None:
    clock = ManualClock()
    tracker = LeaseTracker(clock=clock, flip_memory=60)
    tracker.observe(lease_body("ns-a", "pa", "node-1", "1"))
    tracker.observe(lease_body("ns-b", "pb", "node-1", "1"))
    tracker.observe(lease_body("ns-b", "pc", "node-2", "1"))
    assert tracker.overlaps("ns-a", "pa") == [
        "Pools ns-a/pa and ns-b/pb both run an agent on node node-1 "
        "(Lease ns-b/flexkv-agent-node-1); run one pool per node: give the pools "
        "disjoint spec.placement.nodeSelector"
    ]
    assert tracker.overlaps("ns-b", "pc") == []
    # A Lease that switched pools is reported for both, until flip_memory passes.
    tracker.observe(lease_body("ns-b", "pd", "node-2", "2"))
    assert len(tracker.overlaps("ns-b", "pc")) == 1 and len(tracker.overlaps("ns-b", "pd")) == 1
    clock.now += 61
    assert tracker.overlaps("ns-b", "pc") == [] and tracker.overlaps("ns-b", "pd") == []

"""A pool's status tells the truth: the phase follows the conditions, group health
rolls up into the pool's Ready/Degraded, Progressing means a rollout and nothing
else, overlaps, invalid sizing and removed nodes get Events, and a leader change
whose reply was lost still gets its Event."""

from __future__ import annotations

from typing import Any

from tests.operator.flexkv_harness import FakeAgent, pool_manifest
from tests.operator.reconcile_harness import (
    ManualClock,
    observe_leases,
    reconcile,
    reconcile_context,
)
from tests.support.kube_api import DAEMONSETS, GROUPS, NS, POOLS, ApiServer

LEASE = 10


def status(api: ApiServer, pool: str = "pool") -> dict[str, Any]:
    return dict((api.stored(POOLS, NS, pool) or {}).get("status") or {})


def condition(api: ApiServer, type_: str, pool: str = "pool") -> dict[str, Any]:
    return next(c for c in status(api, pool).get("conditions") or [] if c["type"] == type_)


def events(api: ApiServer, reason: str) -> list[dict[str, Any]]:
    found = [api.stored("v1/events", NS, n) or {} for n in api.names("v1/events", NS)]
    return [e for e in found if e.get("reason") == reason]


def agent(api: ApiServer, node: str, rank: int, size: int, pool: str = "pool") -> FakeAgent:
    return FakeAgent(
        api, pool, node, [{"replica": "r0", "ppRank": rank, "ppSize": size}], lease_duration=LEASE
    )


async def rolled_out(api: ApiServer, desired: int, pool: str = "pool") -> None:
    ds = api.stored(DAEMONSETS, NS, f"{pool}-agent")
    assert ds is not None
    await api.patch_object(
        DAEMONSETS,
        f"{pool}-agent",
        {
            "status": {
                "observedGeneration": ds["metadata"]["generation"],
                "desiredNumberScheduled": desired,
                "updatedNumberScheduled": desired,
                "numberUnavailable": 0,
            }
        },
    )


async def test_ready_pool_turns_degraded_not_ready_on_overlap_with_one_event(
    api: ApiServer,
) -> None:
    await api.create_object(POOLS, pool_manifest("p1"))
    await api.create_object(POOLS, pool_manifest("p2"))
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await agent(api, "node-a", 0, 1, "p1").start()
        await reconcile(ctx, api, "p1")
        await rolled_out(api, 1, "p1")
        await reconcile(ctx, api, "p1")
        assert status(api, "p1")["phase"] == "Ready"

        await agent(api, "node-a", 0, 1, "p2").beat()  # p2 writes the same Lease
        clock.now += 1
        await reconcile(ctx, api, "p1")
        st = status(api, "p1")
        assert condition(api, "Degraded", "p1")["reason"] == "PoolsOverlap"
        assert st["phase"] == "Degraded", "phase follows Degraded, never Ready beside it"
        assert condition(api, "Ready", "p1")["status"] == "False"
        assert "PoolsOverlap" in condition(api, "Ready", "p1")["message"]
        [event] = [e for e in events(api, "PoolsOverlap") if e["involvedObject"]["name"] == "p1"]
        assert event["type"] == "Warning" and "node node-a" in event["message"]
        clock.now += 1
        await reconcile(ctx, api, "p1")
        [event] = [e for e in events(api, "PoolsOverlap") if e["involvedObject"]["name"] == "p1"]
        assert event["count"] == 1, "one Event per change, not per reconcile"


async def test_group_missing_a_stage_makes_the_pool_degraded_not_ready(api: ApiServer) -> None:
    await api.create_object(POOLS, pool_manifest())
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await agent(api, "node-a", 0, 2).start()
        unready = agent(api, "node-b", 1, 2)
        unready.ready = False
        await unready.start()
        await reconcile(ctx, api)
        await rolled_out(api, 1)  # one desired agent, and it is ready
        await reconcile(ctx, api)
        group = (api.stored(GROUPS, NS, "pool-r0") or {})["status"]
        assert group["phase"] == "Degraded"
        assert condition(api, "Degraded")["reason"] == "GroupDegraded"
        assert "pool-r0" in condition(api, "Degraded")["message"]
        assert condition(api, "Ready")["status"] == "False"
        assert status(api)["phase"] == "Degraded"


async def test_lost_agent_on_a_rolled_out_pool_is_degraded_not_progressing(
    api: ApiServer,
) -> None:
    await api.create_object(POOLS, pool_manifest())
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        agents = [agent(api, "node-a", 0, 2), agent(api, "node-b", 1, 2)]
        for one in agents:
            await one.start()
        await reconcile(ctx, api)
        await rolled_out(api, 2)
        await reconcile(ctx, api)
        assert status(api)["phase"] == "Ready"
        clock.now += 6
        await agents[0].beat()
        observe_leases(ctx, api)
        clock.now += 6  # node-b silent for 12 s > 10 s
        await reconcile(ctx, api)
        assert condition(api, "Progressing")["status"] == "False"
        assert condition(api, "Degraded")["reason"] == "HeartbeatLost"
        assert status(api)["phase"] == "Degraded"


async def test_invalid_sizing_gets_a_warning_event(api: ApiServer) -> None:
    response = await api.post(
        "/api/v1/nodes",
        json={
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "small"},
            "status": {"allocatable": {"memory": "1Gi", "ephemeral-storage": "10Gi"}},
        },
    )
    assert response.status < 300
    await api.create_object(POOLS, pool_manifest(tiers={"cpu": {"size": "64Gi"}}))
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)
        assert condition(api, "SizingValid")["status"] == "False"
        [event] = events(api, "SizingInvalid")
        assert event["type"] == "Warning" and "small" in event["message"]


async def test_leader_elected_event_when_the_reply_to_the_group_write_is_lost(
    api: ApiServer,
) -> None:
    lost = api.fail(504, action="update", plural="kvcachegroups", lost_reply=True)
    await api.create_object(POOLS, pool_manifest())
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await agent(api, "node-a", 0, 1).start()
        result = await reconcile(ctx, api)
        assert lost.hits == 1, "the group's status write took effect but its reply was lost"
        group = (api.stored(GROUPS, NS, "pool-r0") or {})["status"]
        assert group["leader"]["node"] == "node-a" and group["epoch"] == 1
        assert result.groups_written == 1
        [event] = events(api, "LeaderElected")
        assert event["involvedObject"]["name"] == "pool-r0" and "epoch 1" in event["message"]

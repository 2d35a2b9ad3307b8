"""Failover nothing else can block: a pool's group election and publication go on
while its spec is invalid, while the API server refuses one of its children, and
right after an API outage, whatever the full reconcile's backoff."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from flexkv_operator.context import OperatorContext
from flexkv_operator.reconcile import GroupSync, ReconcileResult

from tests.operator.flexkv_harness import (
    FAST,
    group_agents,
    heartbeating,
    pool_manifest,
    running_operator,
)
from tests.operator.reconcile_harness import (
    GroupPassLog,
    ManualClock,
    lease_event,
    observe_leases,
    pool_event,
    reconcile,
    reconcile_context,
    running_controller,
)
from tests.support.kube_api import DAEMONSETS, GROUPS, NS, POOLS, ApiServer
from tests.support.waiting import wait_for_async


def group(api: ApiServer, name: str = "pool-r0") -> dict[str, Any]:
    return (api.stored(GROUPS, NS, name) or {}).get("status") or {}


def leader(api: ApiServer) -> str | None:
    return (group(api).get("leader") or {}).get("node")


def condition(api: ApiServer, type_: str, name: str = "pool") -> dict[str, Any]:
    conditions = ((api.stored(POOLS, NS, name) or {}).get("status") or {}).get("conditions")
    return next((dict(c) for c in conditions or [] if c["type"] == type_), {})


def events(api: ApiServer, reason: str) -> list[dict[str, Any]]:
    found = [api.stored("v1/events", NS, n) or {} for n in api.names("v1/events", NS)]
    return [e for e in found if e.get("reason") == reason]


# -- one reconcile at a time, on a hand-moved clock ------------------------------------


async def lose_node_a(ctx: OperatorContext, api: ApiServer, clock: ManualClock) -> None:
    """node-a stops renewing; node-b renews; node-a's 10 s lease expires."""
    clock.now += 6
    await group_agents(api, ["node-a", "node-b"], lease_duration=10)[1].beat()
    observe_leases(ctx, api)
    clock.now += 6


async def test_invalid_spec_does_not_stop_failover(api: ApiServer) -> None:
    await api.create_object(POOLS, pool_manifest())
    for agent in group_agents(api, ["node-a", "node-b"], lease_duration=10):
        await agent.start()
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)
        assert leader(api) == "node-a" and group(api)["epoch"] == 1
        # "0Gi" passes the CRD's pattern but is refused by the operator.
        await api.patch_object(POOLS, "pool", {"spec": {"tiers": {"cpu": {"size": "0Gi"}}}})
        await lose_node_a(ctx, api, clock)
        result = await reconcile(ctx, api)
        assert result.phase == "Invalid"
        assert condition(api, "ConfigValid")["status"] == "False"
        assert leader(api) == "node-b" and group(api)["epoch"] == 2


async def test_refused_child_is_reported_and_does_not_stop_failover(api: ApiServer) -> None:
    refused = api.fail(422, action="create", plural="daemonsets", times=1000)
    await api.create_object(POOLS, pool_manifest())
    for agent in group_agents(api, ["node-a", "node-b"], lease_duration=10):
        await agent.start()
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        result = await reconcile(ctx, api)
        assert result.errors == ("DaemonSet pool-agent: 422 injected 422",)
        assert leader(api) == "node-a", "groups are published although a child was refused"
        degraded = condition(api, "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "ReconcileError"
        assert "DaemonSet pool-agent: 422 injected 422" in degraded["message"]
        assert condition(api, "Ready")["reason"] == "ReconcileError"
        assert api.stored("v1/configmaps", NS, "pool-agent-config") is not None
        [event] = events(api, "ReconcileError")
        assert event["type"] == "Warning" and event["count"] == 1

        # Retried: the same Event counts up instead of a new one per retry.
        clock.now += 1
        await reconcile(ctx, api)
        [event] = events(api, "ReconcileError")
        assert event["count"] == 2 and event["lastTimestamp"] >= event["firstTimestamp"]

        await lose_node_a(ctx, api, clock)
        await reconcile(ctx, api)
        assert leader(api) == "node-b" and group(api)["epoch"] == 2

        refused.remaining = 0
        result = await reconcile(ctx, api)
        assert result.errors == () and api.stored(DAEMONSETS, NS, "pool-agent") is not None
        assert condition(api, "Degraded").get("reason") != "ReconcileError"


# -- the controller's two timers, on looptime's fake clock -----------------------------


@pytest.mark.looptime
async def test_group_pass_runs_at_lease_expiry_while_every_reconcile_fails() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    groups = GroupPassLog(start=start)
    passes = groups.passes
    reconciles: list[float] = []

    async def failing(ctx: OperatorContext, body: dict[str, Any]) -> ReconcileResult:
        reconciles.append(round(loop.time() - start, 3))
        raise RuntimeError("spec invalid, child refused: whatever it is")

    async with running_controller(failing, groups) as ctl:
        ctl.observe_lease("ADDED", lease_event("n1", "r1"))
        ctl.observe_pool("ADDED", pool_event(spec={}))
        await asyncio.sleep(4)
        ctl.observe_lease("MODIFIED", lease_event("n1", "r2"))
        await asyncio.sleep(40)
    # Reconciles back off (0, 0.5, 1.5, 3.5, 7.5, 15.5, 31.5) while the group pass
    # runs exactly when the renewed Lease (t=4) expires, at t=14.
    assert reconciles[:7] == [0.0, 0.5, 1.5, 3.5, 7.5, 15.5, 31.5]
    assert (14.0, 0) in passes
    assert all(fresh == 1 for t, fresh in passes if t < 14.0)


@pytest.mark.looptime
async def test_after_an_api_outage_groups_resume_within_a_second_not_after_backoff() -> None:
    loop = asyncio.get_running_loop()
    outage_ends = 40.0
    passes: list[tuple[float, bool, bool]] = []
    reconciles: list[tuple[float, bool]] = []

    def api_up() -> bool:
        return loop.time() - start >= outage_ends

    async def reconcile_(ctx: OperatorContext, body: dict[str, Any]) -> ReconcileResult:
        reconciles.append((round(loop.time() - start, 3), api_up()))
        if not api_up():
            raise RuntimeError("503 Service Unavailable")
        return ReconcileResult("Ready", 30.0, 0, 0)

    async def groups(ctx: OperatorContext, body: dict[str, Any], relist: bool) -> GroupSync:
        passes.append((round(loop.time() - start, 3), relist, api_up()))
        if not api_up():
            raise RuntimeError("503 Service Unavailable")
        return GroupSync([], [], 30.0)

    start = loop.time()
    async with running_controller(reconcile_, groups) as ctl:
        ctl.observe_pool("ADDED", pool_event(spec={}))
        await asyncio.sleep(60)
    first_ok = next(p for p in passes if p[2])
    # Group passes retry at most every second during the outage, so the first one
    # after it runs within a second, and re-reads the Leases (relist).
    assert outage_ends <= first_ok[0] <= outage_ends + 1.0 and first_ok[1] is True
    # The full reconcile was at 31.5 s of backoff (next try at 63.5): the group pass
    # that found the API back made it due at once.
    first_reconcile_ok = next(t for t, up in reconciles if up)
    assert first_reconcile_ok == first_ok[0]


# -- the real operator -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def pool_with_first_leader(api: ApiServer) -> AsyncIterator[dict[str, bool]]:
    """The real operator, a pool and two agents renewing 3 s Leases (a refused
    renewal is skipped), once node-a leads; yields the agents' ``alive`` map."""
    agents = group_agents(api, ["node-a", "node-b"])
    for agent in agents:
        await agent.start()
    async with running_operator(api), heartbeating(agents, 0.25, skip_refused=True) as alive:
        await api.create_object(POOLS, pool_manifest(**FAST))
        await wait_for_async(lambda: leader(api) == "node-a", "first leader", 10)
        yield alive


async def failover(api: ApiServer, alive: dict[str, bool], timeout: float = 15) -> None:
    assert leader(api) == "node-a"
    epoch = group(api)["epoch"]
    alive["node-a"] = False
    await wait_for_async(
        lambda: leader(api) == "node-b" and group(api)["epoch"] == epoch + 1, "failover", timeout
    )


async def test_operator_fails_over_while_the_spec_is_invalid(api: ApiServer) -> None:
    async with pool_with_first_leader(api) as alive:
        await api.patch_object(POOLS, "pool", {"spec": {"tiers": {"cpu": {"size": "0Gi"}}}})
        await wait_for_async(
            lambda: condition(api, "ConfigValid").get("status") == "False", "invalid", 10
        )
        await failover(api, alive)


async def test_operator_fails_over_and_reports_while_a_child_is_refused(api: ApiServer) -> None:
    api.fail(422, action="create", plural="daemonsets", times=10**6)
    async with pool_with_first_leader(api) as alive:
        await wait_for_async(
            lambda: condition(api, "Degraded").get("reason") == "ReconcileError", "reported", 10
        )
        assert "injected 422" in condition(api, "Degraded")["message"]
        await failover(api, alive)
        await wait_for_async(
            lambda: (events(api, "ReconcileError") or [{}])[0].get("count", 0) >= 2,
            "a retried failure counted on one Event",
            10,
        )
        assert len(events(api, "ReconcileError")) == 1


async def test_operator_fails_over_right_after_its_api_outage(api: ApiServer) -> None:
    async with pool_with_first_leader(api) as alive:
        # Every request of the operator's own client fails (its watches stay open).
        outage = api.fail(503, times=10**6, user_agent="flexkv-operator")
        await api.patch_object(POOLS, "pool", {"spec": {"cacheEpoch": 1}})  # a reconcile that fails
        epoch = group(api)["epoch"]
        alive["node-a"] = False
        stopped = time.monotonic()

        def group_requests() -> int:
            return len(api.requests_from("flexkv-operator", plural="kvcachegroups"))

        # node-a's 3 s Lease has expired by any clock two durations later; then the
        # operator must try the group (a read or the failover's write), refused.
        await wait_for_async(lambda: time.monotonic() - stopped > 6, "node-a's Lease expired", 20)
        seen = group_requests()
        await wait_for_async(lambda: group_requests() > seen,
                             "the operator acting on the group in the outage", 30)
        assert leader(api) == "node-a" and outage.hits > 0, "nothing was written in the outage"
        outage.remaining = 0
        await wait_for_async(
            lambda: leader(api) == "node-b" and group(api)["epoch"] == epoch + 1, "failover", 10
        )

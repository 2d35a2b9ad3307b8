"""The work queue's timing under a fake loop clock (looptime): reconciles happen at
lease expiry and on significant lease changes, failures back off."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from flexkv_operator.context import NodeCache, OperatorContext, OperatorSettings
from flexkv_operator.controller import Controller
from flexkv_operator.kube import Connection, KubeClient
from flexkv_operator.membership import LeaseTracker
from flexkv_operator.reconcile import PoolGone, ReconcileResult

from tests.operator.reconcile_harness import (
    GroupPassLog,
    ReconcileLog,
    lease_event,
    pool_event,
    running_controller,
)
from tests.support.waiting import wait_for_async


async def steady(ctx: OperatorContext, body: dict[str, Any]) -> ReconcileResult:
    return ReconcileResult("Ready", 30.0, 0, 0)


@pytest.mark.looptime
async def test_group_pass_runs_at_lease_expiry_not_before() -> None:
    groups = GroupPassLog(start=asyncio.get_running_loop().time())
    seen = groups.passes
    async with running_controller(steady, groups) as ctl:
        ctl.observe_lease("ADDED", lease_event("n1", "r1"))
        ctl.observe_pool("ADDED", pool_event())
        await asyncio.sleep(4)
        ctl.observe_lease("MODIFIED", lease_event("n1", "r2"))  # a heartbeat: no reconcile now
        await asyncio.sleep(20)
    assert seen[0] == (0.0, 1)
    # Renewed at t=4 (no reconcile for a mere heartbeat), so it expires at t=14: the
    # first reconcile that sees it stale runs exactly then, none earlier saw it stale.
    assert all(t != 4.0 for t, _ in seen)
    first_stale = next(t for t, fresh in seen if fresh == 0)
    assert first_stale == 14.0
    assert all(fresh == 1 for t, fresh in seen if t < 14.0)


@pytest.mark.looptime
async def test_significant_lease_change_and_spec_change_trigger_reconciles() -> None:
    reconcile = ReconcileLog(start=asyncio.get_running_loop().time())
    times = reconcile.times
    async with running_controller(reconcile) as ctl:
        ctl.observe_pool("ADDED", pool_event())
        await asyncio.sleep(1)
        ctl.observe_lease("ADDED", lease_event("n1", "r1"))  # new agent
        await asyncio.sleep(1)
        status_only = pool_event()
        status_only["status"] = {"phase": "Ready"}
        ctl.observe_pool("MODIFIED", status_only)  # our own status write: nothing to do
        await asyncio.sleep(1)
        ctl.observe_pool("MODIFIED", pool_event(spec={"x": 2}))
        await asyncio.sleep(1)
        ctl.observe_lease("MODIFIED", lease_event("n1", "r2", ready=False))
        await asyncio.sleep(1)
        ctl.observe_pool("DELETED", pool_event())
        await asyncio.sleep(60)
    assert times == [0.0, 1.0, 3.0, 4.0]
    assert ctl.pools == {} and len(ctl.ctx.tracker) == 0


@pytest.mark.looptime
async def test_failed_reconciles_back_off_exponentially() -> None:
    reconcile = ReconcileLog(asyncio.get_running_loop().time(), failures=3, requeue=100.0)
    times = reconcile.times
    async with running_controller(reconcile) as ctl:
        ctl.observe_pool("ADDED", pool_event())
        await asyncio.sleep(10)
    assert times == [0.0, 0.5, 1.5, 3.5]
    assert ctl.failures == {}


@pytest.mark.looptime
async def test_a_pool_found_gone_is_forgotten_without_retries() -> None:
    calls: list[str] = []

    async def reconcile(ctx: OperatorContext, body: dict[str, Any]) -> ReconcileResult:
        calls.append(body["metadata"]["name"])
        raise PoolGone("deleted meanwhile")

    async with running_controller(reconcile) as ctl:
        ctl.observe_lease("ADDED", lease_event("n1", "r1"))
        ctl.observe_pool("ADDED", pool_event())
        await asyncio.sleep(60)
    assert calls == ["p"]
    assert ctl.pools == {} and ctl.failures == {} and len(ctl.ctx.tracker) == 0


async def test_no_busy_loop_while_more_pools_are_due_than_slots() -> None:
    """Three pools due, one slot: the loop must sleep until the running reconcile
    ends instead of spinning on a zero timeout (it reads the clock once per turn): over
    two hundred turns of the event loop it turns only a few times."""
    turns = 0
    release = asyncio.Event()
    started: list[str] = []

    async def reconcile(ctx: OperatorContext, body: dict[str, Any]) -> ReconcileResult:
        started.append(body["metadata"]["name"])
        await asyncio.wait_for(release.wait(), timeout=5)
        return ReconcileResult("Ready", 30.0, 0, 0)

    async with running_controller(reconcile) as ctl:
        ctl.concurrency = 1
        loop_clock = ctl.ctx.clock

        def counting_clock() -> float:
            nonlocal turns
            turns += 1
            return loop_clock()

        ctl.ctx.clock = counting_clock
        for name in ("a", "b", "c"):
            ctl.observe_pool("ADDED", pool_event(name))
        for _ in range(200):  # two hundred turns of the event loop; no clock involved
            await asyncio.sleep(0)
        assert started == ["a"]
        assert turns < 20, f"the controller loop turned {turns} times while waiting for a slot"
        release.set()
        await wait_for_async(lambda: len(started) == 3, "the other two reconciles", 10)
        assert sorted(started) == ["a", "b", "c"]


def test_a_lease_switching_pools_marks_both_pools_due() -> None:
    """The pool that lost the Lease must be reconciled too (it reports PoolsOverlap)."""
    clock = [0.0]
    ctx = OperatorContext(
        client=KubeClient(Connection(server="http://127.0.0.1:9")),
        settings=OperatorSettings(identity="t", default_image="i", service_account="s"),
        clock=lambda: clock[0],
        tracker=LeaseTracker(clock=lambda: clock[0]),
        nodes=NodeCache(ttl=60, clock=lambda: clock[0]),
    )
    ctl = Controller(ctx)
    ctl.observe_pool("ADDED", pool_event("p"))
    ctl.observe_pool("ADDED", pool_event("q"))
    ctl.observe_lease("ADDED", lease_event("n1", "r1"))
    ctl.due.clear()
    moved = lease_event("n1", "r2")
    moved["metadata"]["labels"]["flexkv.io/pool"] = "q"
    ctl.observe_lease("MODIFIED", moved)
    assert set(ctl.due) == {("ns", "p"), ("ns", "q")}

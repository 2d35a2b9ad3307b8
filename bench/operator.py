"""Operator benchmark: pool apply -> Ready, and leader loss -> new leader published,
with 10, 100 and 1000 agents against the emulated API server (kmock).

Each result is one JSON object on its own line. Goals are ratios measured in the
same run:

* ``failover_over_bound`` = failover seconds / (leaseDurationSeconds + 2); goal <= 1;
* ``per_agent_ratio_vs_smallest`` = (ready seconds per agent at N) / (the same at the
  smallest N of the run); ~1 or below means reconcile work grows linearly (or better).

Setup: the operator runs in a thread of this process, as in the tests; agents are
heartbeat Leases written over HTTP. Agents are grouped into PP groups of two. The
measured group's agents heartbeat every second with the pool's lease duration;
the other agents carry a long lease duration and renew slowly, so the emulated
server is not saturated by heartbeats on a 2-core machine (their Leases are still
watched, tracked and reported on every reconcile).

    python bench/operator.py            # 10, 100, 1000 agents, then the failover cases
    python bench/operator.py --quick    # 10 and 100 agents, shorter leases
    python bench/operator.py --cases    # only the failover cases

Failover cases (one PP group of two agents, lease 3 s, each line
``"bench": "operator-failover"``): the leader's agent stops renewing and the time
to its successor being published is measured while

* ``plain``: nothing else happens;
* ``invalid-spec``: the pool's spec is invalid (``tiers.cpu.size: 0Gi``);
* ``child-refused``: the API server refuses the pool's DaemonSet (422);
* ``api-outage``: the operator's own requests fail (503) from the loss until 3 s
  after the lease expired (and a spec change sends its reconcile into backoff);
  also measured from the API coming back (goal <= 2 s);
* ``active-killed``: two operator replicas (operator lease 3 s); the active one
  is cut off from the API server at the same moment; bound lease + 2 s + the
  operator lease.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' emulated API server and operator harness

from tests.operator.flexkv_harness import (  # noqa: E402
    FakeAgent,
    heartbeating,
    pool_manifest,
    running_operator,
)
from tests.support.kube_api import DAEMONSETS, GROUPS, NS, POOLS, ApiServer, api_server  # noqa: E402
from tests.support.waiting import wait_for_async  # noqa: E402

BACKGROUND_LEASE = 120
BACKGROUND_PERIOD = 30.0


def emit(result: dict[str, Any]) -> None:
    print(json.dumps(result, sort_keys=True), flush=True)


def agents_for(api: ApiServer, count: int, lease: int) -> list[FakeAgent]:
    agents = []
    for i in range(count):
        group, rank = divmod(i, 2)
        size = 2 if group * 2 + 1 < count else 1
        measured = group == 0
        agents.append(
            FakeAgent(
                api,
                "pool",
                f"node-{i:04d}",
                [{"replica": f"r{group:04d}", "ppRank": rank, "ppSize": size}],
                lease_duration=lease if measured else BACKGROUND_LEASE,
            )
        )
    return agents


@contextlib.asynccontextmanager
async def heartbeats(
    fast: list[FakeAgent], slow: list[FakeAgent], alive: dict[str, bool]
) -> AsyncIterator[None]:
    async def fast_loop() -> None:
        while True:
            await asyncio.gather(*(a.beat() for a in fast if alive[a.node]))
            await asyncio.sleep(1.0)

    async def slow_loop() -> None:
        # Spread the background renewals evenly over the period.
        gap = BACKGROUND_PERIOD / max(1, len(slow))
        while True:
            for agent in slow:
                await agent.beat()
                await asyncio.sleep(gap)

    tasks = [asyncio.create_task(fast_loop()), asyncio.create_task(slow_loop())]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def run_size(count: int, timings: dict[str, int], timeout: float) -> dict[str, Any]:
    lease = timings["leaseDurationSeconds"]
    async with api_server(history_limit=64) as api:
        agents = agents_for(api, count, lease)
        started = time.monotonic()
        for chunk in range(0, count, 50):
            await asyncio.gather(*(a.start() for a in agents[chunk : chunk + 50]))
        setup_s = time.monotonic() - started
        alive = {a.node: True for a in agents}
        fast, slow = agents[:2], agents[2:]
        async with running_operator(api, "bench"), heartbeats(fast, slow, alive):
            applied = time.monotonic()
            await api.create_object(POOLS, pool_manifest(leaderElection=timings))
            ds = await wait_for_async(
                lambda: api.stored(DAEMONSETS, NS, "pool-agent"), "DaemonSet", timeout
            )
            await api.patch_object(
                DAEMONSETS,
                "pool-agent",
                {
                    "status": {
                        "observedGeneration": ds["metadata"]["generation"],
                        "desiredNumberScheduled": count,
                        "updatedNumberScheduled": count,
                        "numberAvailable": count,
                        "numberUnavailable": 0,
                    }
                },
            )

            def ready() -> bool:
                status = (api.stored(POOLS, NS, "pool") or {}).get("status") or {}
                return status.get("phase") == "Ready" and status.get("readyAgents") == count

            await wait_for_async(ready, f"Ready with {count} agents", timeout, interval=0.02)
            ready_s = time.monotonic() - applied
            groups = len(api.names(GROUPS, NS))

            def leader() -> str | None:
                status = (api.stored(GROUPS, NS, "pool-r0000") or {}).get("status") or {}
                return (status.get("leader") or {}).get("node")

            await wait_for_async(lambda: leader() == "node-0000", "first leader", timeout)
            await asyncio.sleep(1.0)
            alive["node-0000"] = False
            await fast[0].beat()  # the last heartbeat: the loss starts now
            lost_at = time.monotonic()
            await wait_for_async(
                lambda: leader() not in ("node-0000", None),
                "new leader",
                lease + timeout,
                interval=0.02,
            )
            failover_s = time.monotonic() - lost_at
    bound = lease + 2.0
    return {
        "bench": "operator",
        "agents": count,
        "groups": groups,
        "lease_duration_s": lease,
        "lease_setup_s": round(setup_s, 3),
        "apply_to_ready_s": round(ready_s, 3),
        "ready_per_agent_ms": round(1000 * ready_s / count, 3),
        "failover_s": round(failover_s, 3),
        "failover_bound_s": bound,
        "failover_over_bound": round(failover_s / bound, 3),
        "failover_goal_met": failover_s <= bound,
    }


CASE_LEASE = 3
CASE_TIMINGS = {
    "leaseDurationSeconds": CASE_LEASE,
    "renewDeadlineSeconds": 2,
    "retryPeriodSeconds": 1,
}
OPERATOR_LEASE = 3.0
ELECTION = {
    "leader_election": True,
    "election_lease_duration": OPERATOR_LEASE,
    "election_renew_deadline": 2.0,
    "election_retry_period": 0.5,
}


async def run_case(case: str, timeout: float = 60.0) -> dict[str, Any]:
    """One failover case (module docstring)."""
    async with api_server() as api:
        agents = [
            FakeAgent(
                api,
                "pool",
                node,
                [{"replica": "r0", "ppRank": rank, "ppSize": 2}],
                lease_duration=CASE_LEASE,
            )
            for rank, node in enumerate(["node-a", "node-b"])
        ]
        for agent in agents:
            await agent.start()
        if case == "child-refused":
            api.fail(422, action="create", plural="daemonsets", times=10**6)
        operators = [("operator-a", ELECTION if case == "active-killed" else {})]
        if case == "active-killed":
            operators.append(("operator-b", ELECTION))
        async with contextlib.AsyncExitStack() as stack:
            alive = await stack.enter_async_context(heartbeating(agents, 0.25))
            for identity, extra in operators:
                await stack.enter_async_context(running_operator(api, identity, **extra))
            await api.create_object(POOLS, pool_manifest(leaderElection=CASE_TIMINGS))

            def leader() -> str | None:
                status = (api.stored(GROUPS, NS, "pool-r0") or {}).get("status") or {}
                return (status.get("leader") or {}).get("node")

            await wait_for_async(lambda: leader() == "node-a", "first leader", timeout)
            if case == "invalid-spec":
                await api.patch_object(POOLS, "pool", {"spec": {"tiers": {"cpu": {"size": "0Gi"}}}})
                await asyncio.sleep(1.0)
            await asyncio.sleep(1.0)
            alive["node-a"] = False
            await agents[0].beat()  # the last heartbeat: the loss starts now
            lost_at = time.monotonic()
            back_at = None
            if case == "api-outage":
                outage = api.fail(503, times=10**6, user_agent="flexkv-operator")
                await api.patch_object(POOLS, "pool", {"spec": {"cacheEpoch": 1}})
                await asyncio.sleep(CASE_LEASE + 3.0)
                outage.remaining = 0
                back_at = time.monotonic()
            if case == "active-killed":
                api.fail(503, times=10**6, user_agent="flexkv-operator/operator-a")
            await wait_for_async(
                lambda: leader() not in ("node-a", None), "new leader", timeout, interval=0.02
            )
            done = time.monotonic()
    failover_s = done - lost_at
    bound = CASE_LEASE + 2.0 + (OPERATOR_LEASE if case == "active-killed" else 0.0)
    result: dict[str, Any] = {
        "bench": "operator-failover",
        "case": case,
        "lease_duration_s": CASE_LEASE,
        "failover_s": round(failover_s, 3),
        "failover_bound_s": bound,
        "failover_over_bound": round(failover_s / bound, 3),
    }
    if back_at is not None:
        result["after_api_back_s"] = round(done - back_at, 3)
        result["after_api_back_bound_s"] = 2.0
        result["failover_over_bound"] = round((done - back_at) / 2.0, 3)
    result["goal_met"] = result["failover_over_bound"] <= 1.0
    return result


CASES = ["plain", "invalid-spec", "child-refused", "api-outage", "active-killed"]


async def main_async(quick: bool, cases_only: bool = False) -> None:
    if cases_only:
        case_results = [await run_case(case) for case in CASES]
        for result in case_results:
            emit(result)
        emit(
            {
                "bench": "operator-summary",
                "cases": CASES,
                "max_case_failover_over_bound": max(r["failover_over_bound"] for r in case_results),
            }
        )
        return
    sizes = [10, 100] if quick else [10, 100, 1000]
    timings = (
        {"leaseDurationSeconds": 3, "renewDeadlineSeconds": 2, "retryPeriodSeconds": 1}
        if quick
        else {"leaseDurationSeconds": 6, "renewDeadlineSeconds": 4, "retryPeriodSeconds": 2}
    )
    results = []
    for count in sizes:
        result = await run_size(count, timings, timeout=60.0)
        results.append(result)
    baseline = results[0]["ready_per_agent_ms"]
    for result in results:
        result["per_agent_ratio_vs_smallest"] = round(result["ready_per_agent_ms"] / baseline, 3)
        emit(result)
    case_results = [] if quick else [await run_case(case) for case in CASES]
    for result in case_results:
        emit(result)
    summary: dict[str, Any] = {
        "bench": "operator-summary",
        "sizes": sizes,
        "max_failover_over_bound": max(r["failover_over_bound"] for r in results),
        "per_agent_ratio_at_largest": results[-1]["per_agent_ratio_vs_smallest"],
    }
    if case_results:
        summary["max_case_failover_over_bound"] = max(
            r["failover_over_bound"] for r in case_results
        )
    emit(summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 and 100 agents, short leases")
    parser.add_argument("--cases", action="store_true", help="only the failover cases")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    asyncio.run(main_async(args.quick, args.cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())

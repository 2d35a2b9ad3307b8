"""Active/passive operator replicas: one coordination.k8s.io Lease, client-go rules.

Against the emulated API server: the Lease's life (create, renew, take-over after
the holder went silent, release on shutdown, a race between standbys), and real
operators: only the active replica writes (two replicas that render differently
do not fight), and when the active one is cut off the standby takes over and
completes a group failover."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from flexkv_operator.active_replica import LeaderElection
from flexkv_operator.kube import Connection, KubeClient

from tests.operator.flexkv_harness import (
    FAST,
    heartbeating,
    pool_manifest,
    running_operator,
    start_group,
)
from tests.operator.reconcile_harness import ManualClock
from tests.support.kube_api import DAEMONSETS, GROUPS, LEASES, NS, POOLS, ApiServer
from tests.support.waiting import wait_for_async

ELECTION = {
    "leader_election": True,
    "election_lease_duration": 3.0,
    "election_renew_deadline": 2.0,
    "election_retry_period": 0.5,
}


@contextlib.asynccontextmanager
async def electors(
    api: ApiServer, clock: ManualClock, *identities: str
) -> AsyncIterator[list[LeaderElection]]:
    async with KubeClient(Connection(server=str(api.url)), retries=0) as client:
        changes: list[tuple[str, bool]] = []
        yield [
            LeaderElection(
                client=client,
                namespace=NS,
                name="flexkv-operator",
                identity=identity,
                clock=clock,
                lease_duration=15,
                renew_deadline=10,
                retry_period=2,
                on_change=lambda active, who=identity: changes.append((who, active)),
            )
            for identity in identities
        ]


def holder(api: ApiServer) -> str:
    return str(
        ((api.stored(LEASES, NS, "flexkv-operator") or {}).get("spec") or {}).get("holderIdentity")
    )


async def test_lease_is_taken_over_only_after_the_holder_went_silent(api: ApiServer) -> None:
    clock = ManualClock()
    async with electors(api, clock, "a", "b") as (a, b):
        assert await a.try_acquire_or_renew() and a.active
        assert not await b.try_acquire_or_renew() and not b.active
        for _ in range(3):  # a renews; b keeps seeing a change and stays standby
            clock.now += 5
            assert await a.try_acquire_or_renew()
            assert not await b.try_acquire_or_renew()
        clock.now += 11
        assert not a.active, "a steps down once it has not renewed for the renew deadline"
        clock.now += 3  # 14 s since b saw the Lease change: still within 15 s
        assert not await b.try_acquire_or_renew()
        clock.now += 1
        assert await b.try_acquire_or_renew() and b.active
        spec = (api.stored(LEASES, NS, "flexkv-operator") or {})["spec"]
        assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
        assert not await a.try_acquire_or_renew(), "b renewed just now"


async def test_released_lease_is_taken_at_once_and_racing_standbys_get_one_holder(
    api: ApiServer,
) -> None:
    clock = ManualClock()
    async with electors(api, clock, "a", "b", "c") as (a, b, c):
        assert await a.try_acquire_or_renew()
        await a.release()
        assert holder(api) == "" and not a.active
        # b and c read the same released version; the conditional writes let one win.
        results = await asyncio.gather(b.try_acquire_or_renew(), c.try_acquire_or_renew())
        assert sorted(results) == [False, True]
        assert holder(api) in ("b", "c")


def writes_by(api: ApiServer, identity: str) -> list[str]:
    """Writes (not the operator Lease, not Events) by one replica's own client."""
    return [
        f"{request.method} {request.url}"
        for request in api.requests_from(
            f"flexkv-operator/{identity}", methods=("POST", "PATCH", "DELETE")
        )
        if not (
            request.resource is not None
            and request.resource.plural == "leases"
            and request.name == "flexkv-operator"
        )
    ]


def election_requests(api: ApiServer, identity: str, *methods: str) -> int:
    """How many requests one replica sent for the operator Lease (renewals, tries)."""
    return len(
        api.requests_from(
            f"flexkv-operator/{identity}", methods=methods, plural="leases", name="flexkv-operator"
        )
    )


def template_image(api: ApiServer) -> str:
    ds = api.stored(DAEMONSETS, NS, "pool-agent") or {}
    return str(ds["spec"]["template"]["spec"]["containers"][0]["image"])


async def test_only_the_active_replica_writes_so_different_renderings_do_not_fight(
    api: ApiServer,
) -> None:
    async with running_operator(api, "operator-a", image="img:1", **ELECTION):
        await wait_for_async(lambda: holder(api) == "operator-a", "operator-a active", 10)
        async with running_operator(api, "operator-b", image="img:2", **ELECTION):
            await api.create_object(POOLS, pool_manifest(**FAST))
            await wait_for_async(lambda: api.stored(DAEMONSETS, NS, "pool-agent"), "DaemonSet", 10)
            version = api.stored(DAEMONSETS, NS, "pool-agent")["metadata"]["resourceVersion"]  # type: ignore[index]
            # Several rounds of both replicas: the active one renews, the standby tries.
            renewed = election_requests(api, "operator-a", "PATCH") + 4
            tried = election_requests(api, "operator-b") + 4
            await wait_for_async(
                lambda: (
                    election_requests(api, "operator-a", "PATCH") >= renewed
                    and election_requests(api, "operator-b") >= tried
                ),
                "four renewals by operator-a and four tries by operator-b",
                20,
            )
            assert template_image(api) == "img:1"
            assert (
                api.stored(DAEMONSETS, NS, "pool-agent")["metadata"]["resourceVersion"] == version
            )  # type: ignore[index]
            assert writes_by(api, "operator-b") == []
            assert holder(api) == "operator-a"
        # b stopped; a stays active
        assert holder(api) == "operator-a"


async def test_standby_takes_over_and_fails_over_when_the_active_replica_is_cut_off(
    api: ApiServer,
) -> None:
    agents = await start_group(api, ["node-a", "node-b"])
    async with (
        heartbeating(agents, 0.25) as alive,
        running_operator(api, "operator-a", **ELECTION),
    ):
        await wait_for_async(lambda: holder(api) == "operator-a", "operator-a active", 10)
        async with running_operator(api, "operator-b", **ELECTION):
            await api.create_object(POOLS, pool_manifest(**FAST))
            group = lambda: (api.stored(GROUPS, NS, "pool-r0") or {}).get("status") or {}  # noqa: E731
            await wait_for_async(
                lambda: (group().get("leader") or {}).get("node") == "node-a", "leader", 10
            )
            assert group()["electedBy"] == "operator-a"
            # operator-a loses the API server (its node is lost) and node-a dies too.
            api.fail(503, times=10**6, user_agent="flexkv-operator/operator-a")
            alive["node-a"] = False
            cut = time.monotonic()
            await wait_for_async(
                lambda: (group().get("leader") or {}).get("node") == "node-b", "failover", 20
            )
            took = time.monotonic() - cut
            assert group()["electedBy"] == "operator-b" and group()["epoch"] == 2
            assert holder(api) == "operator-b"
            lease = (api.stored(LEASES, NS, "flexkv-operator") or {})["spec"]
            assert lease["leaseTransitions"] == 1
            # Reported, not asserted (bench/operator.py measures it): the bound is the
            # agent's lease (3 s) + 2 s + the operator lease (3 s).
            print(f"standby failover: {took:.2f}s")

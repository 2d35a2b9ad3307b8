"""Agent Leases are owned by their pods and go with their pool: the emulated API
server's garbage collector deletes owned objects, a deleted pool's Leases are gone,
and a pool created afterwards on the same nodes sees no ghost overlap, also when the
deleted pool's agent renews its Lease after the operator forgot the pool and the new
pool's agent takes that Lease over before it is collected."""

from __future__ import annotations

import logging
import threading
from typing import Any

from flexkv_operator import names
from flexkv_operator.membership import LeaseTracker

from tests.operator.flexkv_harness import (
    FAST,
    FakeAgent,
    heartbeating,
    pool_manifest,
    running_operator,
)
from tests.operator.reconcile_harness import (
    ManualClock,
    observe_leases,
    reconcile,
    reconcile_context,
)
from tests.support.kube_api import DAEMONSETS, GROUPS, LEASES, NS, POOLS, ApiServer
from tests.support.waiting import wait_for_async

PODS = "v1/pods"


def owner(obj: dict[str, Any], controller: bool = False) -> dict[str, Any]:
    ref = {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
    }
    if controller:
        ref["controller"] = True
    return ref


async def agent_pod(api: ApiServer, pool: str, node: str) -> dict[str, Any]:
    """The agent pod the DaemonSet controller would create (owned by the DaemonSet)."""
    ds = api.stored(DAEMONSETS, NS, f"{pool}-agent")
    assert ds is not None
    return await api.create_object(
        PODS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{pool}-agent-{node}",
                "namespace": NS,
                "ownerReferences": [owner(ds, controller=True)],
            },
            "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "x"}]},
        },
    )


def pool_status(api: ApiServer, pool: str) -> dict[str, Any]:
    return dict((api.stored(POOLS, NS, pool) or {}).get("status") or {})


def events(api: ApiServer) -> list[dict[str, Any]]:
    return [api.stored("v1/events", NS, n) or {} for n in api.names("v1/events", NS)]


def condition(api: ApiServer, pool: str, type_: str) -> dict[str, Any]:
    conditions = pool_status(api, pool).get("conditions")
    return next((dict(c) for c in conditions or [] if c["type"] == type_), {})


async def test_emulator_collects_owned_objects_recursively(api: ApiServer) -> None:
    root = await api.create_object(
        "v1/configmaps", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}}
    )
    child = await api.create_object(
        "v1/configmaps",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "b", "ownerReferences": [owner(root)]},
        },
    )
    await api.create_object(
        "v1/configmaps",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "ownerReferences": [owner(child)]},
        },
    )
    other = await api.create_object(
        "v1/configmaps", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "d"}}
    )
    await api.create_object(
        "v1/configmaps",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "e", "ownerReferences": [owner(root), owner(other)]},
        },
    )
    await api.delete_object("v1/configmaps", "a")
    await wait_for_async(lambda: api.names("v1/configmaps", NS) == ["d", "e"], "collection", 10)
    # "e" has another live owner ("d"), so it stays, as with the real collector.


async def test_deleted_pools_leases_are_collected_and_leave_no_ghost_overlap(
    api: ApiServer,
) -> None:
    async with running_operator(api):
        await api.create_object(POOLS, pool_manifest("old", **FAST))
        await wait_for_async(lambda: api.stored(DAEMONSETS, NS, "old-agent"), "old DaemonSet", 10)
        pod = await agent_pod(api, "old", "node-a")
        old = FakeAgent(
            api,
            "old",
            "node-a",
            [{"replica": "r0", "ppRank": 0, "ppSize": 1}],
            owner=owner(pod),
        )
        await old.start()
        async with heartbeating([old], 0.25) as alive:
            await wait_for_async(lambda: api.stored(GROUPS, NS, "old-r0"), "old group", 10)
            alive["node-a"] = False
        await api.delete_object(POOLS, "old")
        # pool -> DaemonSet -> pod -> Lease, each through its owner reference.
        await wait_for_async(
            lambda: names.lease_name("node-a") not in api.names(LEASES, NS), "Lease collected", 10
        )
        assert api.names(PODS, NS) == [] and api.names(GROUPS, NS) == []

        await api.create_object(POOLS, pool_manifest("new", **FAST))
        await wait_for_async(lambda: api.stored(DAEMONSETS, NS, "new-agent"), "new DaemonSet", 10)
        new = FakeAgent(
            api,
            "new",
            "node-a",
            [{"replica": "r0", "ppRank": 0, "ppSize": 1}],
            owner=owner(await agent_pod(api, "new", "node-a")),
        )
        await new.start()
        async with heartbeating([new], 0.25):
            await wait_for_async(
                lambda: ((api.stored(POOLS, NS, "new") or {}).get("status") or {}).get("groups"),
                "new pool's groups in its status",
                10,
            )
            degraded = condition(api, "new", "Degraded")
            assert degraded.get("reason") != "PoolsOverlap", degraded
            assert "old" not in degraded.get("message", "")


def test_forgetting_a_pool_forgets_its_flips() -> None:
    clock = [0.0]
    tracker = LeaseTracker(clock=lambda: clock[0])

    def lease(pool: str, version: str) -> dict[str, Any]:
        return {
            "metadata": {
                "name": names.lease_name("node-a"),
                "namespace": NS,
                "resourceVersion": version,
                "labels": {
                    names.LABEL_NAME: names.AGENT_APP,
                    names.LABEL_POOL: pool,
                    names.LABEL_NODE: "node-a",
                },
                "annotations": {names.ANNOTATION_MEMBERSHIPS: "[]"},
            },
            "spec": {"renewTime": version, "leaseDurationSeconds": 3},
        }

    tracker.observe(lease("old", "1"))
    tracker.observe(lease("new", "2"))  # the Lease switched pools
    assert tracker.overlaps(NS, "new") != []
    tracker.forget_pool(NS, "old")
    assert tracker.overlaps(NS, "new") == []


class _Forgotten(logging.Handler):
    """Sets ``event`` when the operator logs that it forgot ``pool``."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.pool = pool
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if (
            record.getMessage() == "Pool deleted; forgetting it"
            and getattr(record, "pool", None) == self.pool
        ):
            self.event.set()


async def test_a_late_renewal_of_a_deleted_pools_agent_never_makes_an_overlap_with_a_new_pool(
    api: ApiServer,
) -> None:
    """Pool ``old`` is deleted; its agent's last renewal (ready=false) arrives after the
    operator forgot the pool, and pool ``new``'s agent then takes over the same node
    Lease before any garbage collection: ``new`` names no overlap with a pool that no
    longer exists, in its status or in an Event."""
    forgotten = _Forgotten("old")
    controller_log = logging.getLogger("flexkv_operator.controller")
    controller_log.addHandler(forgotten)
    level = controller_log.level
    controller_log.setLevel(logging.INFO)
    try:
        async with running_operator(api):
            await api.create_object(POOLS, pool_manifest("old", **FAST))
            old = FakeAgent(api, "old", "node-a", [{"replica": "r0", "ppRank": 0, "ppSize": 1}])
            await old.start()
            async with heartbeating([old], 0.25):
                await wait_for_async(lambda: api.stored(GROUPS, NS, "old-r0"), "old group", 10)
            await api.delete_object(POOLS, "old")
            await wait_for_async(forgotten.event.is_set, "the operator forgetting pool old", 10)
            # The old agent's last renewal, as it shuts down, lands after the forget.
            old.ready = False
            await old.beat()
            assert names.lease_name("node-a") in api.names(LEASES, NS)  # not collected yet

            await api.create_object(POOLS, pool_manifest("new", **FAST))
            new = FakeAgent(api, "new", "node-a", [{"replica": "r0", "ppRank": 0, "ppSize": 1}])
            async with heartbeating([new], 0.25):  # takes the node's Lease over
                await wait_for_async(lambda: api.stored(GROUPS, NS, "new-r0"), "new group", 10)
                await wait_for_async(
                    lambda: (
                        pool_status(api, "new").get("readyAgents") == 1
                        and pool_status(api, "new").get("groupCount") == 1
                    ),
                    "pool new's status with its agent and group",
                    10,
                )
                degraded = condition(api, "new", "Degraded")
                assert degraded.get("reason") != "PoolsOverlap", degraded
                assert "old" not in degraded.get("message", ""), degraded
    finally:
        controller_log.setLevel(level)
        controller_log.removeHandler(forgotten)
    overlap_events = [e for e in events(api) if e.get("reason") == "PoolsOverlap"]
    assert overlap_events == [], [
        (e["involvedObject"]["name"], e.get("message")) for e in overlap_events
    ]


async def test_a_pool_deleted_during_its_reconcile_posts_no_overlap_event(api: ApiServer) -> None:
    """Pool ``old`` is reconciled while ``new``'s agent takes over its node Lease, and
    ``old`` is deleted before the reconcile writes its status: the status write finds
    nothing, and no ``PoolsOverlap`` Event is posted for the deleted pool."""
    await api.create_object(POOLS, pool_manifest("old", **FAST))
    await api.create_object(POOLS, pool_manifest("new", **FAST))
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await FakeAgent(api, "old", "node-a").start()
        observe_leases(ctx, api)
        await FakeAgent(api, "new", "node-a").beat()  # takes the node's Lease over
        body = api.stored(POOLS, NS, "old")
        assert body is not None
        write = ctx.client.patch

        async def deleted_before_status(path: str, patch_body: dict[str, Any]) -> dict[str, Any]:
            if path.endswith("/kvcachepools/old/status"):
                await api.delete_object(POOLS, "old")  # the user deletes the pool meanwhile
            return await write(path, patch_body)

        ctx.client.patch = deleted_before_status  # type: ignore[method-assign]
        await reconcile(ctx, api, "old")
        assert api.stored(POOLS, NS, "old") is None
    assert [e for e in events(api) if e.get("reason") == "PoolsOverlap"] == []

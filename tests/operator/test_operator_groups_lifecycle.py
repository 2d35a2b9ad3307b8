"""KVCacheGroup lifecycle against the emulated API server: a deleted group comes
back with a leader and a higher epoch, the group cache expires instead of sliding,
and two replicas whose names sanitise alike never overwrite each other's group."""

from __future__ import annotations

import kmock
from flexkv_operator.controller import Controller
from flexkv_operator.group_publisher import GroupCache

from tests.operator.flexkv_harness import FakeAgent, pool_manifest, start_group
from tests.operator.reconcile_harness import ManualClock, reconcile, reconcile_context
from tests.support.kube_api import GROUPS, NS, POOLS, ApiServer

LONG_LEASE = 600  # no expiry during these tests unless the clock is moved that far


def group_status(api: ApiServer, name: str = "pool-r0") -> dict[str, object]:
    return dict((api.stored(GROUPS, NS, name) or {}).get("status") or {})


def group_fetches(api: ApiServer) -> int:
    return sum(
        1
        for r in api[kmock.action.FETCH]
        if r.resource is not None and r.resource.plural == "kvcachegroups"
    )


async def test_deleted_group_is_recreated_with_a_leader_above_its_old_epoch(
    api: ApiServer,
) -> None:
    await api.create_object(POOLS, pool_manifest())
    await start_group(api, ["node-a", "node-b"], lease_duration=LONG_LEASE)
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)
        assert group_status(api)["epoch"] == 1
        old_uid = api.stored(GROUPS, NS, "pool-r0")["metadata"]["uid"]  # type: ignore[index]

        # Deleted by hand while the cache still holds it; a member change makes the
        # next reconcile write, and the write's 404 makes it create the group again.
        await api.delete_object(GROUPS, "pool-r0")
        await FakeAgent(
            api,
            "pool",
            "node-b",
            [{"replica": "r0", "ppRank": 1, "ppSize": 2}],
            ready=False,
            lease_duration=LONG_LEASE,
        ).beat()
        clock.now += 1
        await reconcile(ctx, api)

        recreated = api.stored(GROUPS, NS, "pool-r0")
        assert recreated is not None and recreated["metadata"]["uid"] != old_uid
        st = group_status(api)
        assert st["leader"] == {
            "node": "node-a",
            "ppRank": 0,
            "fanoutEndpoint": st["members"][0]["fanoutEndpoint"],  # type: ignore[index]
        }
        assert st["epoch"] == 2, "a re-created group must start above the epoch it had"
        pool_groups = api.stored(POOLS, NS, "pool")["status"]["groups"]  # type: ignore[index]
        assert [(g["name"], g["epoch"]) for g in pool_groups] == [("pool-r0", 2)]

        # Deleted again with nothing to write: the cache entry expires, the GET finds
        # nothing, the group is created again, above the epoch the pool recorded.
        await api.delete_object(GROUPS, "pool-r0")
        clock.now += 31
        await reconcile(ctx, api)
        st = group_status(api)
        assert st["epoch"] == 3 and st["leader"]["node"] == "node-a"  # type: ignore[index]


async def test_group_cache_expires_after_its_ttl_and_does_not_slide(api: ApiServer) -> None:
    await api.create_object(POOLS, pool_manifest())
    await start_group(api, ["node-a"], lease_duration=LONG_LEASE)
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)  # GET (404), create, status write: cached at t=0
        first = group_fetches(api)
        clock.now += 20
        await reconcile(ctx, api)  # nothing changed: decided from the cache
        assert group_fetches(api) == first
        clock.now += 15  # 35 s after the last real exchange with the server
        await reconcile(ctx, api)
        assert group_fetches(api) == first + 1, "a cached group must be re-read after the TTL"


async def test_forgetting_a_pool_or_deleting_a_stale_group_drops_cache_entries(
    api: ApiServer,
) -> None:
    await api.create_object(POOLS, pool_manifest())
    await start_group(api, ["node-a"], lease_duration=LONG_LEASE)
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        assert ctx.groups is not None
        await reconcile(ctx, api)
        assert ctx.groups.get(f"{NS}/pool-r0") is not None
        Controller(ctx).forget_pool((NS, "pool"))
        assert ctx.groups.get(f"{NS}/pool-r0") is None

        await reconcile(ctx, api)
        assert ctx.groups.get(f"{NS}/pool-r0") is not None
        # The agent leaves the replica: its group is deleted and forgotten.
        await FakeAgent(api, "pool", "node-a", [], lease_duration=LONG_LEASE).beat()
        clock.now += 1
        await reconcile(ctx, api)
        assert api.names(GROUPS, NS) == []
        assert ctx.groups.get(f"{NS}/pool-r0") is None


def test_group_cache_forget_pool_keeps_other_pools() -> None:
    cache = GroupCache(clock=lambda: 0.0)
    cache.put("ns/a-r0", {"spec": {"poolRef": "a"}})
    cache.put("ns/b-r0", {"spec": {"poolRef": "b"}})
    cache.put("other/a-r0", {"spec": {"poolRef": "a"}})
    cache.forget_pool("ns", "a")
    assert cache.get("ns/a-r0") is None
    assert cache.get("ns/b-r0") is not None and cache.get("other/a-r0") is not None


async def test_pools_whose_group_names_collide_never_take_over_each_others_group(
    api: ApiServer,
) -> None:
    """Pool "a" replica "b-c" and pool "a-b" replica "c" both map to "a-b-c"."""
    await api.create_object(POOLS, pool_manifest("a"))
    await api.create_object(POOLS, pool_manifest("a-b"))
    await start_group(api, ["node-a"], pool="a", replica="b-c", lease_duration=LONG_LEASE)
    await start_group(api, ["node-b"], pool="a-b", replica="c", lease_duration=LONG_LEASE)
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api, "a")
        owner = api.stored(GROUPS, NS, "a-b-c")
        assert owner is not None
        await reconcile(ctx, api, "a-b")

        after = api.stored(GROUPS, NS, "a-b-c")
        assert after is not None
        assert after["spec"] == {"poolRef": "a", "replica": "b-c", "ppSize": 1}
        assert after["status"]["leader"]["node"] == "node-a"
        assert after["metadata"]["resourceVersion"] == owner["metadata"]["resourceVersion"]
        st = api.stored(POOLS, NS, "a-b")["status"]  # type: ignore[index]
        degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "GroupNameConflict"
        assert "poolRef='a' replica='b-c'" in degraded["message"]
        assert "poolRef='a-b' replica='c'" in degraded["message"]
        assert st["groups"] == [] and st["groupCount"] == 0


async def test_replicas_of_one_pool_that_sanitise_alike_get_one_group_and_an_error(
    api: ApiServer,
) -> None:
    await api.create_object(POOLS, pool_manifest())
    await start_group(api, ["node-a"], replica="Llama_0", lease_duration=LONG_LEASE)
    await start_group(api, ["node-b"], replica="llama.0", lease_duration=LONG_LEASE)
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)
        await reconcile(ctx, api)
        stored = api.stored(GROUPS, NS, "pool-llama-0")
        assert stored is not None
        winner = stored["spec"]["replica"]
        assert winner in ("Llama_0", "llama.0")
        leader = stored["status"]["leader"]["node"]
        assert leader == {"Llama_0": "node-a", "llama.0": "node-b"}[winner]
        st = api.stored(POOLS, NS, "pool")["status"]  # type: ignore[index]
        degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] == "GroupNameConflict"
        assert "'Llama_0'" in degraded["message"] and "'llama.0'" in degraded["message"]

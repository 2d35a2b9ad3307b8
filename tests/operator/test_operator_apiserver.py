"""The emulated API server's additions to kmock behave like the real API server."""

from __future__ import annotations

from typing import Any

from tests.support.kube_api import NS, POOLS, ApiServer
from tests.support.waiting import wait_for_async

POOL_PATH = f"/apis/flexkv.io/v1alpha1/namespaces/{NS}/kvcachepools"


async def test_create_assigns_identity_and_drops_status(api: ApiServer) -> None:
    body = await api.create_object(
        POOLS, {"metadata": {"name": "p"}, "spec": {"a": 1}, "status": {"x": 1}}
    )
    meta = body["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["generation"] == 1
    assert "status" not in body


async def test_patches_bump_resource_version_and_generation_on_spec_only(api: ApiServer) -> None:
    first = await api.create_object(POOLS, {"metadata": {"name": "p"}, "spec": {"a": 1}})
    labelled = await api.patch_object(POOLS, "p", {"metadata": {"labels": {"x": "y"}}})
    assert int(labelled["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    assert labelled["metadata"]["generation"] == 1
    respec = await api.patch_object(POOLS, "p", {"spec": {"a": 2}})
    assert respec["metadata"]["generation"] == 2


async def test_status_subresource_changes_only_status(api: ApiServer) -> None:
    await api.create_object(POOLS, {"metadata": {"name": "p"}, "spec": {"a": 1}})
    response = await api.patch(
        f"{POOL_PATH}/p/status", json={"spec": {"a": 9}, "status": {"phase": "X"}}
    )
    body = await response.json()
    assert body["spec"] == {"a": 1} and body["status"] == {"phase": "X"}
    assert body["metadata"]["generation"] == 1
    ignored = await api.patch_object(POOLS, "p", {"status": {"phase": "Y"}})
    assert ignored["status"] == {"phase": "X"}


async def test_stale_resource_version_precondition_is_a_409(api: ApiServer) -> None:
    first = await api.create_object(POOLS, {"metadata": {"name": "p"}, "spec": {}})
    rv = first["metadata"]["resourceVersion"]
    ok = await api.patch(
        f"{POOL_PATH}/p/status", json={"metadata": {"resourceVersion": rv}, "status": {"e": 1}}
    )
    assert ok.status == 200
    stale = await api.patch(
        f"{POOL_PATH}/p/status", json={"metadata": {"resourceVersion": rv}, "status": {"e": 2}}
    )
    assert stale.status == 409
    assert api.stored(POOLS, NS, "p")["status"] == {"e": 1}  # type: ignore[index]
    assert api.conflicts == 1


async def test_delete_with_a_stale_resource_version_precondition_is_a_409(
    api: ApiServer,
) -> None:
    first = await api.create_object(POOLS, {"metadata": {"name": "p"}, "spec": {}})
    rv = first["metadata"]["resourceVersion"]
    await api.patch_object(POOLS, "p", {"spec": {"a": 1}})
    options = {"kind": "DeleteOptions", "preconditions": {"resourceVersion": rv}}
    stale = await api.delete(f"{POOL_PATH}/p", json=options)
    assert stale.status == 409 and api.stored(POOLS, NS, "p") is not None
    current = api.stored(POOLS, NS, "p")["metadata"]["resourceVersion"]  # type: ignore[index]
    options["preconditions"] = {"resourceVersion": current}
    ok = await api.delete(f"{POOL_PATH}/p", json=options)
    assert ok.status == 200 and api.stored(POOLS, NS, "p") is None
    assert api.conflicts == 1


async def test_injected_faults_answer_before_touching_state(api: ApiServer) -> None:
    fault = api.fail(500, action="create", plural="kvcachepools", times=2)
    for _ in range(2):
        response = await api.post(POOL_PATH, json={"metadata": {"name": "p"}, "spec": {}})
        assert response.status == 500
    assert api.stored(POOLS, NS, "p") is None and fault.hits == 2
    await api.create_object(POOLS, {"metadata": {"name": "p"}, "spec": {}})
    assert api.stored(POOLS, NS, "p") is not None


async def test_group_publication_from_a_stale_cache_conflicts_then_rereads(api: ApiServer) -> None:
    """A cached group version someone else has since changed costs one 409, never a
    second leader for an epoch."""
    import datetime

    from flexkv_operator.group_election import Candidate
    from flexkv_operator.group_publisher import GroupCache, GroupMember, GroupPlan, publish_group
    from flexkv_operator.kube import Connection, KubeClient

    pool_body = await api.create_object(POOLS, {"metadata": {"name": "p"}, "spec": {}})
    now = datetime.datetime.now(datetime.UTC)
    a = GroupMember(Candidate("a", 0, "tcp://a:1", True, True), now)
    b = GroupMember(Candidate("b", 1, "tcp://b:1", True, True), now)
    clock = [0.0]
    cache = GroupCache(clock=lambda: clock[0], ttl=30)
    async with KubeClient(Connection(server=str(api.url))) as client:

        async def publish(*members: GroupMember) -> Any:
            return await publish_group(
                client,
                pool_body=pool_body,
                plan=GroupPlan("r", 2, members),
                identity="x",
                heartbeat_slack=10,
                now=now,
                cache=cache,
            )

        first = await publish(a, b)
        assert first.written and first.epoch == 1 and first.leader == a.candidate
        # Another writer publishes leader b at epoch 2 behind the cache's back.
        path = f"/apis/flexkv.io/v1alpha1/namespaces/{NS}/kvcachegroups/p-r/status"
        other = {"epoch": 2, "leader": {"node": "b", "ppRank": 1, "fanoutEndpoint": "tcp://b:1"}}
        assert (await api.patch(path, json={"status": other})).status == 200
        lost_a = GroupMember(Candidate("a", 0, "tcp://a:1", True, False), now)
        second = await publish(lost_a, b)
    # The cache still said "leader a, epoch 1": the write conflicted, the re-read saw b
    # at epoch 2, which is fresh, so nothing changes.
    assert second.conflicts == 1 and second.epoch == 2 and second.leader == b.candidate
    stored = api.stored("flexkv.io/v1alpha1/kvcachegroups", NS, "p-r")
    assert stored is not None and stored["status"]["epoch"] == 2
    assert stored["status"]["leader"]["node"] == "b"


async def test_an_object_created_for_an_already_deleted_owner_is_collected(
    api: ApiServer,
) -> None:
    """A client that read its owner before the owner's deletion may create a dependent
    after it: the garbage collector deletes that orphan too, as the real one does."""
    owner = await api.create_object(POOLS, {"metadata": {"name": "p"}, "spec": {}})
    await api.delete_object(POOLS, "p")
    reference = {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCachePool",
        "name": "p",
        "uid": owner["metadata"]["uid"],
    }
    body = {"metadata": {"name": "late", "ownerReferences": [reference]}, "data": {}}
    await api.create_object("v1/configmaps", body)
    await wait_for_async(
        lambda: api.names("v1/configmaps", NS) == [], "the orphan's collection", 10
    )
    assert ("configmaps", NS, "late") in api.collected

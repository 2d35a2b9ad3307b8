"""The emulated API server's additions to kmock behave like the real API server."""

from __future__ import annotations

from flexkv_apiserver import ApiServer
from flexkv_harness import NS, POOLS, create, patch

POOL_PATH = f"/apis/flexkv.io/v1alpha1/namespaces/{NS}/kvcachepools"


async def test_create_assigns_identity_and_drops_status(api: ApiServer) -> None:
    body = await create(
        api, POOLS, {"metadata": {"name": "p"}, "spec": {"a": 1}, "status": {"x": 1}}
    )
    meta = body["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["generation"] == 1
    assert "status" not in body


async def test_patches_bump_resource_version_and_generation_on_spec_only(api: ApiServer) -> None:
    first = await create(api, POOLS, {"metadata": {"name": "p"}, "spec": {"a": 1}})
    labelled = await patch(api, POOLS, "p", {"metadata": {"labels": {"x": "y"}}})
    assert int(labelled["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    assert labelled["metadata"]["generation"] == 1
    respec = await patch(api, POOLS, "p", {"spec": {"a": 2}})
    assert respec["metadata"]["generation"] == 2


async def test_status_subresource_changes_only_status(api: ApiServer) -> None:
    await create(api, POOLS, {"metadata": {"name": "p"}, "spec": {"a": 1}})
    response = await api.patch(
        f"{POOL_PATH}/p/status", json={"spec": {"a": 9}, "status": {"phase": "X"}}
    )
    body = await response.json()
    assert body["spec"] == {"a": 1} and body["status"] == {"phase": "X"}
    assert body["metadata"]["generation"] == 1
    ignored = await patch(api, POOLS, "p", {"status": {"phase": "Y"}})
    assert ignored["status"] == {"phase": "X"}


async def test_stale_resource_version_precondition_is_a_409(api: ApiServer) -> None:
    first = await create(api, POOLS, {"metadata": {"name": "p"}, "spec": {}})
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


async def test_injected_faults_answer_before_touching_state(api: ApiServer) -> None:
    fault = api.fail(500, action="create", plural="kvcachepools", times=2)
    for _ in range(2):
        response = await api.post(POOL_PATH, json={"metadata": {"name": "p"}, "spec": {}})
        assert response.status == 500
    assert api.stored(POOLS, NS, "p") is None and fault.hits == 2
    await create(api, POOLS, {"metadata": {"name": "p"}, "spec": {}})
    assert api.stored(POOLS, NS, "p") is not None

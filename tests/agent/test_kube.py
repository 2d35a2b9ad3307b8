"""Heartbeat Lease and group views against the emulated Kubernetes API (kmock).

The ``kubernetes`` client is synchronous and kmock serves on the test's event
loop, so every direct client call here goes through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from node_agent.config import config_from_mapping
from node_agent.kube.group_watch import KubeGroupSource
from node_agent.kube.groups import FileGroupSource, parse_group
from node_agent.kube.heartbeat import LeaseHeartbeat, lease_name
from node_agent.vocab.group_view import GroupView, GroupViewError
from node_agent.vocab.recent_errors import RecentErrors
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(60)

LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
GROUPS = kmock.resource("flexkv.io", "v1alpha1", "kvcachegroups")


def _cfg(**extra: Any) -> Any:
    base = {"pool": "p1", "namespace": "ns1", "nodeName": "node-a", "podName": "agent-xyz",
            "heartbeat": {"leaseDurationSeconds": 3, "renewDeadlineSeconds": 2,
                          "retryPeriodSeconds": 0.1},
            "ports": {"http": 8080, "fanout": 5557}, "advertiseAddress": "10.0.0.7"}
    base.update(extra)
    return config_from_mapping(base)


def _info() -> dict[str, Any]:
    return {"memberships": [{"replica": "llama-0", "ppRank": 0, "ppSize": 2}],
            "tiers": {"cpu": {"capacityBytes": 100, "usedBytes": 10}},
            "ready": True, "cacheEpoch": 4}


async def test_emulator_refuses_stale_resource_version(kube: Any, kube_api: Any) -> None:
    api = k8s.CoordinationV1Api(kube_api)
    body = {"metadata": {"name": "x", "namespace": "ns1"}, "spec": {"holderIdentity": "a"}}
    created = await asyncio.to_thread(api.create_namespaced_lease, "ns1", body)
    rv = created.metadata.resource_version
    assert rv and created.metadata.uid
    patched = await asyncio.to_thread(
        api.patch_namespaced_lease, "x", "ns1",
        {"metadata": {"resourceVersion": rv}, "spec": {"holderIdentity": "b"}})
    assert int(patched.metadata.resource_version) > int(rv)
    with pytest.raises(ApiException) as err:
        await asyncio.to_thread(api.patch_namespaced_lease, "x", "ns1",
                                {"metadata": {"resourceVersion": rv}, "spec": {}})
    assert err.value.status == 409


async def test_heartbeat_creates_and_renews_lease_per_contract(kube: Any, kube_api: Any) -> None:
    cfg = _cfg()
    hb = LeaseHeartbeat(k8s.CoordinationV1Api(kube_api), cfg, _info)
    await hb.start()
    try:
        key = (LEASES, "ns1", lease_name("node-a"))
        assert key in kube.objects
        lease = kube.objects[key]
        meta, spec = lease["metadata"], lease["spec"]
        assert meta["labels"] == {"app.kubernetes.io/name": "flexkv-agent",
                                  "flexkv.io/pool": "p1", "flexkv.io/node": "node-a"}
        ann = meta["annotations"]
        assert json.loads(ann["flexkv.io/endpoints"]) == {
            "http": "10.0.0.7:8080", "fanout": "tcp://10.0.0.7:5557"}
        assert json.loads(ann["flexkv.io/memberships"]) == _info()["memberships"]
        assert json.loads(ann["flexkv.io/tiers"]) == _info()["tiers"]
        assert ann["flexkv.io/ready"] == "true"
        assert ann["flexkv.io/cache-epoch"] == "4"
        assert spec["holderIdentity"] == "agent-xyz"
        assert spec["leaseDurationSeconds"] == 3
        first = spec["renewTime"]
        await wait_for_async(lambda: hb.renewals >= 3, "three Lease renewals", 5)
        assert kube.objects[key]["spec"]["renewTime"] != first
        assert hb.healthy and hb.alive
    finally:
        await hb.stop()
    assert kube.objects[key]["metadata"]["annotations"]["flexkv.io/ready"] == "false"
    assert not hb.alive


async def test_heartbeat_lease_is_owned_by_the_agent_pod(kube: Any, kube_api: Any) -> None:
    """With the downward API's POD_UID the Lease names its pod as owner, so the garbage
    collector deletes it with the pod; without a uid no owner is claimed."""
    cfg = config_from_mapping({"pool": "p1", "namespace": "ns1",
                               "nodeName": "node-a", "podName": "agent-xyz",
                               "podUid": "0b5e-uid", "advertiseAddress": "10.0.0.7"})
    hb = LeaseHeartbeat(k8s.CoordinationV1Api(kube_api), cfg, _info)
    await asyncio.to_thread(hb.renew_once)
    await asyncio.to_thread(hb.renew_once)  # a renewal keeps the owner
    lease = kube.objects[(LEASES, "ns1", lease_name("node-a"))]
    assert lease["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "agent-xyz", "uid": "0b5e-uid"}]
    assert LeaseHeartbeat(k8s.CoordinationV1Api(kube_api), _cfg(), _info).owner_references() == []


async def test_heartbeat_rereads_after_conflict_and_recreates_deleted_lease(
    kube: Any, kube_api: Any
) -> None:
    api = k8s.CoordinationV1Api(kube_api)
    hb = LeaseHeartbeat(api, _cfg(), _info, errors=RecentErrors())
    await asyncio.to_thread(hb.renew_once)
    name = lease_name("node-a")
    # Another writer changes the Lease: the heartbeat's known version is now stale.
    await asyncio.to_thread(api.patch_namespaced_lease, name, "ns1",
                            {"metadata": {"annotations": {"other": "x"}}})
    before = hb.renewals
    await asyncio.to_thread(hb.renew_once)
    assert hb.conflicts == 1 and hb.renewals == before + 1
    await asyncio.to_thread(api.delete_namespaced_lease, name, "ns1")
    await asyncio.to_thread(hb.renew_once)
    assert (LEASES, "ns1", name) in kube.objects
    assert not kube.objects[LEASES, "ns1", name].deleted


async def test_heartbeat_reports_unreachable_api_and_is_unhealthy() -> None:
    conf = k8s.Configuration()
    conf.host = "http://127.0.0.1:9"  # discard port: nothing listens
    errors = RecentErrors()
    hb = LeaseHeartbeat(k8s.CoordinationV1Api(k8s.ApiClient(conf)), _cfg(), _info, errors=errors)
    await hb.start()
    try:
        await wait_for_async(lambda: len(errors.snapshot()) >= 1, "an error recorded", 5)
        assert not hb.healthy
        assert "Lease ns1/flexkv-agent-node-a renewal failed" in errors.snapshot()[0]["message"]
    finally:
        await hb.stop()


def _group(name: str, pool: str, epoch: int | None, leader_rank: int = 0) -> dict[str, Any]:
    members = [{"node": f"node-{r}", "ppRank": r, "fanoutEndpoint": f"tcp://10.0.0.{r}:5557",
                "ready": True} for r in range(2)]
    obj: dict[str, Any] = {
        "apiVersion": "flexkv.io/v1alpha1", "kind": "KVCacheGroup",
        "metadata": {"name": name, "namespace": "ns1", "labels": {"flexkv.io/pool": pool}},
        "spec": {"poolRef": pool, "replica": name.removeprefix(f"{pool}-"), "ppSize": 2},
    }
    if epoch is not None:
        obj["status"] = {"epoch": epoch, "leader": members[leader_rank], "members": members,
                         "phase": "Ready"}
    return obj


def test_parse_group_reads_contract_shape_and_rejects_garbage() -> None:
    view = parse_group(_group("p1-llama-0", "p1", 3))
    assert isinstance(view, GroupView)
    assert (view.replica, view.pp_size, view.epoch) == ("llama-0", 2, 3)
    assert view.leader is not None and view.leader.fanout_endpoint == "tcp://10.0.0.0:5557"
    assert [m.pp_rank for m in view.members] == [0, 1]
    assert parse_group(_group("p1-llama-0", "p1", None)) is None
    bad = _group("p1-llama-0", "p1", 3)
    bad["status"]["leader"] = {"node": "n"}
    with pytest.raises(GroupViewError, match=r"status\.leader"):
        parse_group(bad)


async def test_kube_group_source_lists_then_follows_watch_events(kube: Any,
                                                               kube_api: Any) -> None:
    kube.objects[GROUPS, "ns1", "p1-llama-0"] = _group("p1-llama-0", "p1", 1)
    kube.objects[GROUPS, "ns1", "p2-other"] = _group("p2-other", "p2", 7)
    api = k8s.CustomObjectsApi(kube_api)
    seen: list[dict[str, GroupView]] = []
    src = KubeGroupSource(api, "ns1", "p1", seen.append, period=0.05)
    await src.start()
    try:
        assert src.known and list(seen[-1]) == ["llama-0"] and src.lists == 1
        assert seen[-1]["llama-0"].epoch == 1
        n = len(seen)
        await wait_for_async(lambda: src.events >= 1,
                             "the watch replaying the current objects", 5)
        # The operator elects another leader: a status write through the API.
        new = _group("p1-llama-0", "p1", 2, leader_rank=1)
        await asyncio.to_thread(api.patch_namespaced_custom_object_status, "flexkv.io",
                                "v1alpha1", "ns1", "kvcachegroups", "p1-llama-0",
                                {"status": new["status"]})
        await wait_for_async(lambda: seen[-1]["llama-0"].epoch == 2, "llama-0 at epoch 2", 5)
        # The change is the one delivery since the list: the watch's replay of the
        # unchanged objects (handled before it, on the same stream) delivered nothing.
        assert len(seen) == n + 1, "unchanged views must not be delivered again"
        leader = seen[-1]["llama-0"].leader
        assert leader is not None and leader.pp_rank == 1
        # A new group, as the operator publishes one: the object, then its status.
        created = _group("p1-llama-1", "p1", 4)
        await asyncio.to_thread(api.create_namespaced_custom_object, "flexkv.io", "v1alpha1",
                                "ns1", "kvcachegroups", created)
        await asyncio.to_thread(api.patch_namespaced_custom_object_status, "flexkv.io",
                                "v1alpha1", "ns1", "kvcachegroups", "p1-llama-1",
                                {"status": created["status"]})
        await wait_for_async(lambda: sorted(seen[-1]) == ["llama-0", "llama-1"],
                             "both groups seen", 5)
        await asyncio.to_thread(api.delete_namespaced_custom_object, "flexkv.io", "v1alpha1",
                                "ns1", "kvcachegroups", "p1-llama-0")
        await wait_for_async(lambda: sorted(seen[-1]) == ["llama-1"], "llama-0 gone", 5)
        assert src.lists == 1, "a healthy watch needs no new list"
    finally:
        await src.stop()


async def test_kube_group_source_reports_errors_and_recovers(kube: Any, kube_api: Any) -> None:
    errors = RecentErrors()
    seen: list[dict[str, GroupView]] = []
    failing = kube.fail(500, action="list", plural="kvcachegroups", times=10**6)
    src = KubeGroupSource(k8s.CustomObjectsApi(kube_api), "ns1", "p1", seen.append,
                          period=0.05, errors=errors)
    await src.start()
    try:
        await wait_for_async(lambda: len(errors.snapshot()) >= 1, "an error recorded", 5)
        assert not src.known
        failing.remaining = 0  # lists succeed again
        kube.objects[GROUPS, "ns1", "p1-llama-0"] = _group("p1-llama-0", "p1", 3)
        await wait_for_async(lambda: bool(seen) and seen[-1]["llama-0"].epoch == 3,
                             "llama-0 at epoch 3", 5)
        assert src.known and src.alive
    finally:
        await src.stop()


async def test_file_group_source_reads_file_and_reports_missing(tmp_path: Path) -> None:
    path = tmp_path / "groups.yaml"
    errors = RecentErrors()
    seen: list[dict[str, GroupView]] = []
    src = FileGroupSource(path, "p1", seen.append, period=0.05, errors=errors)
    await src.start()
    try:
        await wait_for_async(lambda: len(errors.snapshot()) >= 1, "an error recorded", 5)
        assert "does not exist" in errors.snapshot()[0]["message"] and not src.known
        tmp = tmp_path / "tmp.yaml"
        tmp.write_text(yaml.safe_dump({"items": [_group("p1-llama-0", "p1", 5)]}))
        tmp.replace(path)
        await wait_for_async(lambda: bool(seen), "a view", 5)
        assert seen[-1]["llama-0"].epoch == 5 and src.known
    finally:
        await src.stop()

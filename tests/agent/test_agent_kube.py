"""Agents wired to the emulated Kubernetes API: the heartbeat Lease reflects
registrations and readiness, and KVCacheGroup status drives the connectors' roles
(including a leader change)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import kmock
import numpy as np
import pytest
from kubernetes import client as k8s

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.pp.auth import CurveKeys
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    agent_mapping,
    cfg_of,
    running_agent,
    wait_http,
)
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(90)
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")
GROUPS = kmock.resource("flexkv.io", "v1alpha1", "kvcachegroups")


def _annotations(kube: Any, node: str) -> dict[str, str]:
    key = (LEASES, "ns1", f"flexkv-agent-{node}")
    if key not in kube.objects:
        return {}
    ann: dict[str, str] = kube.objects[key]["metadata"]["annotations"]
    return ann


def _group(fanout: dict[int, int], leader: int, epoch: int) -> dict[str, Any]:
    members = [{"node": f"node-{r}", "ppRank": r, "fanoutEndpoint": f"tcp://127.0.0.1:{p}",
                "ready": True} for r, p in sorted(fanout.items())]
    return {"apiVersion": "flexkv.io/v1alpha1", "kind": "KVCacheGroup",
            "metadata": {"name": "tp-rep", "namespace": "ns1",
                         "labels": {"flexkv.io/pool": "tp"}},
            "spec": {"poolRef": "tp", "replica": "rep", "ppSize": 2},
            "status": {"epoch": epoch, "leader": members[leader], "members": members}}


async def test_lease_reports_memberships_and_readiness(kube: Any, kube_api: Any,
                                                       work: Path) -> None:
    cfg = cfg_of(agent_mapping(work, "solo", podName="agent-pod-1"))
    async with running_agent(cfg, kube_api=kube_api) as ra:
        await wait_for_async(
            lambda: _annotations(kube, "solo").get("flexkv.io/ready") == "false",
            "Lease created, not ready", 10)
        ann = _annotations(kube, "solo")
        assert json.loads(ann["flexkv.io/memberships"]) == []
        assert json.loads(ann["flexkv.io/tiers"])["cpu"]["capacityBytes"] == 2**20
        lease = kube.objects[LEASES, "ns1", "flexkv-agent-solo"]
        assert lease["spec"]["holderIdentity"] == "agent-pod-1"
        health = (await ra.get("/healthz")).json()["components"]
        assert health == {"engine_api": True, "group_view": True, "heartbeat": True}

        bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
        client = EngineClient(cfg.engine_socket, RankInfo("solo-0"), timeout=5)
        try:
            await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)
            await wait_for_async(
                lambda: _annotations(kube, "solo").get("flexkv.io/ready") == "true",
                "Lease says ready", 10)
            ann = _annotations(kube, "solo")
            assert json.loads(ann["flexkv.io/memberships"]) == [
                {"replica": "solo-0", "ppRank": 0, "ppSize": 1}]
            assert json.loads(ann["flexkv.io/endpoints"]) == {
                "http": f"127.0.0.1:{cfg.ports.http}", "fanout": f"tcp://127.0.0.1:{cfg.ports.fanout}"}
            status = (await ra.get("/status")).json()
            assert status["heartbeat"]["healthy"] is True
        finally:
            client.close()
            bufs.close()
    # Stopped: the last renewal says not ready, and the Lease is left to expire.
    assert _annotations(kube, "solo")["flexkv.io/ready"] == "false"


async def test_kvcachegroup_status_drives_roles_and_failover(kube: Any, kube_api: Any,
                                                             work: Path) -> None:
    CurveKeys.generate().write(work / "curve")
    maps = [agent_mapping(work, f"node-{r}") for r in range(2)]
    fanout = {r: m["ports"]["fanout"] for r, m in enumerate(maps)}
    kube.objects[GROUPS, "ns1", "tp-rep"] = _group(fanout, leader=0, epoch=1)
    cfgs = [cfg_of(m) for m in maps]
    bufs = [SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS) for _ in range(2)]
    clients = [EngineClient(c.engine_socket, RankInfo("rep", pp_rank=r, pp_size=2), timeout=5)
               for r, c in enumerate(cfgs)]
    try:
        async with running_agent(cfgs[0], kube_api) as a0, running_agent(cfgs[1], kube_api) as a1:
            for c, b in zip(clients, bufs, strict=True):
                await asyncio.to_thread(c.register_kv_buffers, LAYOUT, b.handles)
            await wait_http(a0, "/readyz", 200, 20)
            await wait_http(a1, "/readyz", 200, 20)

            async def role(a: Any) -> str:
                return str((await a.get("/status")).json()["stages"][0]["connector"]["role"])

            assert (await role(a0), await role(a1)) == ("leader", "follower")
            # The operator elects stage 1 at epoch 2: the roles follow the object.
            await asyncio.to_thread(
                k8s.CustomObjectsApi(kube_api).patch_namespaced_custom_object_status, "flexkv.io",
                "v1alpha1", "ns1", "kvcachegroups", "tp-rep",
                {"status": _group(fanout, leader=1, epoch=2)["status"]})
            async def swapped() -> bool:
                return (await role(a0), await role(a1)) == ("follower", "leader")

            await wait_for_async(swapped, "the roles swapped", 20, interval=0.1)
            await wait_http(a1, "/readyz", 200, 20)
            status = (await a1.get("/status")).json()
            assert status["groups"]["rep"]["epoch"] == 2
            assert status["stages"][0]["connector"]["epoch"] == 2
            # The group works under the new leader: a store on both stages completes.
            tokens = np.arange(16, dtype=np.int64)
            results = await asyncio.gather(*[
                asyncio.to_thread(c.store_kv, "s1", tokens, np.arange(16)) for c in clients])
            assert all(r >= 0 for r in results)
    finally:
        for c in clients:
            c.close()
        for b in bufs:
            b.close()


async def test_lease_reports_the_lookups_and_hits_of_the_stages_it_leads(
        kube: Any, kube_api: Any, work: Path) -> None:
    cfg = cfg_of(agent_mapping(work, "counting"))
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    client = EngineClient(cfg.engine_socket, RankInfo("counting-0"), timeout=5)
    try:
        async with running_agent(cfg, kube_api=kube_api):
            await asyncio.to_thread(client.register_kv_buffers, LAYOUT, bufs.handles)
            stored_tokens = np.arange(1000, 1032, dtype=np.int64)
            assert await asyncio.to_thread(
                client.store_kv, "a", stored_tokens, np.arange(32)) >= 0
            await wait_for_async(lambda: "a" in client.poll_completed(), "store of a completed", 10)
            # 32 stored tokens found, then 16 tokens nothing holds.
            assert await asyncio.to_thread(client.lookup, "hit", stored_tokens) == 32
            await asyncio.to_thread(client.release, "hit")
            assert await asyncio.to_thread(
                client.lookup, "miss", np.arange(5000, 5016, dtype=np.int64)) == 0
            await asyncio.to_thread(client.release, "miss")

            def counted() -> dict[str, int] | None:
                text = _annotations(kube, "counting").get("flexkv.io/lookups")
                value: dict[str, int] | None = json.loads(text) if text else None
                return value if value and value["lookupTokens"] >= 48 else None

            await wait_for_async(counted, "the Lease counting both lookups", 20)
            lookups = counted()
            assert lookups is not None
            assert (lookups["lookupTokens"], lookups["hitTokens"]) == (48, 32)
            assert 0 <= lookups["windowSeconds"] <= 300 + cfg.heartbeat.retry_period_seconds
    finally:
        client.close()
        bufs.close()


async def test_a_lookups_window_with_nothing_to_report_is_removed_from_the_lease(
        kube: Any, kube_api: Any, work: Path) -> None:
    from node_agent.kube.heartbeat import LeaseHeartbeat

    cfg = cfg_of(agent_mapping(work, "quiet"))
    info: dict[str, Any] = {"memberships": [], "tiers": {}, "ready": True, "cacheEpoch": 0,
                            "lookups": None}
    beat = LeaseHeartbeat(k8s.CoordinationV1Api(kube_api), cfg, lambda: dict(info))
    await asyncio.to_thread(beat.renew_once)  # created without the annotation
    assert "flexkv.io/lookups" not in _annotations(kube, "quiet")
    info["lookups"] = {"windowSeconds": 30, "lookupTokens": 64, "hitTokens": 16}
    await asyncio.to_thread(beat.renew_once)
    assert json.loads(_annotations(kube, "quiet")["flexkv.io/lookups"])["hitTokens"] == 16
    info["lookups"] = None  # the stage that counted stopped leading
    await asyncio.to_thread(beat.renew_once)
    assert "flexkv.io/lookups" not in _annotations(kube, "quiet")
    assert _annotations(kube, "quiet")["flexkv.io/ready"] == "true"

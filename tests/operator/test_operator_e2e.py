"""The real operator (kopf) against the emulated API server: lifecycle, rollout,
deletion, failover, racing operators, restarts, API faults and bad specs."""

from __future__ import annotations

import base64
from typing import Any

import kmock
import yaml
from flexkv_operator.names import ANNOTATION_CONFIG_HASH

from tests.operator.flexkv_harness import (
    FAST,
    FakeAgent,
    corrupt_curve_secret,
    curve_secret_repaired,
    group_agents,
    heartbeating,
    pool_manifest,
    running_operator,
    start_group,
)
from tests.support.kube_api import DAEMONSETS, GROUPS, NS, POOLS, ApiServer
from tests.support.waiting import wait_for_async

LEASE, RETRY = 3.0, 1.0
BEAT = 0.25  # the agents' renewal period in the tests that keep them alive
CHILDREN = {
    "v1/configmaps": ["pool-agent-config"],
    "v1/secrets": ["pool-curve"],
    "v1/services": ["pool-agent-local", "pool-agents"],
    "policy/v1/poddisruptionbudgets": ["pool-agent"],
    DAEMONSETS: ["pool-agent"],
}


def pool(api: ApiServer, name: str = "pool") -> dict[str, Any]:
    return api.stored(POOLS, NS, name) or {}


def status(api: ApiServer, name: str = "pool") -> dict[str, Any]:
    result: dict[str, Any] = pool(api, name).get("status") or {}
    return result


def condition(api: ApiServer, type_: str, name: str = "pool") -> dict[str, Any]:
    for entry in status(api, name).get("conditions") or []:
        if entry["type"] == type_:
            return dict(entry)
    return {}


def group(api: ApiServer, name: str = "pool-r0") -> dict[str, Any]:
    return (api.stored(GROUPS, NS, name) or {}).get("status") or {}


def event_reasons(api: ApiServer) -> list[str]:
    return [
        (api.stored("v1/events", NS, n) or {}).get("reason", "") for n in api.names("v1/events", NS)
    ]


async def mark_rolled_out(api: ApiServer, desired: int) -> None:
    ds = api.stored(DAEMONSETS, NS, "pool-agent")
    assert ds is not None
    await api.patch_object(
        DAEMONSETS,
        "pool-agent",
        {
            "status": {
                "observedGeneration": ds["metadata"]["generation"],
                "desiredNumberScheduled": desired,
                "updatedNumberScheduled": desired,
                "numberAvailable": desired,
                "numberUnavailable": 0,
            }
        },
    )


async def test_pool_creates_children_and_becomes_ready(api: ApiServer) -> None:
    async with running_operator(api):
        created = await api.create_object(POOLS, pool_manifest(**FAST))
        uid = created["metadata"]["uid"]
        await wait_for_async(
            lambda: all(api.names(k, NS) == v for k, v in CHILDREN.items()), "children", 10
        )
        for plural, names in CHILDREN.items():
            for name in names:
                child = api.stored(plural, NS, name)
                assert child is not None
                assert [o["uid"] for o in child["metadata"]["ownerReferences"]] == [uid], plural
        agent_yaml = yaml.safe_load(
            api.stored("v1/configmaps", NS, "pool-agent-config")["data"]["agent.yaml"]
        )  # type: ignore[index]
        assert agent_yaml["pool"] == "pool" and agent_yaml["heartbeat"]["leaseDurationSeconds"] == 3
        await wait_for_async(
            lambda: status(api).get("phase") == "Pending", "Pending without agents", 10
        )

        agents = await start_group(api, ["node-a", "node-b"])
        await mark_rolled_out(api, 2)
        async with heartbeating(agents, 0.5):
            await wait_for_async(lambda: status(api).get("phase") == "Ready", "pool Ready", 10)
            st = status(api)
            assert st["readyAgents"] == 2 and st["desiredAgents"] == 2 and st["groupCount"] == 1
            assert st["observedGeneration"] == 1
            assert {a["node"] for a in st["agents"]} == {"node-a", "node-b"}
            assert st["agents"][0]["tiers"]["cpu"]["capacityBytes"] == 1 << 30
            assert st["groups"] == [
                {
                    "name": "pool-r0",
                    "replica": "r0",
                    "leader": "node-a",
                    "epoch": 1,
                    "members": ["node-a/0", "node-b/1"],
                }
            ]
            types = {c["type"]: c["status"] for c in st["conditions"]}
            assert types == {
                "Ready": "True",
                "Progressing": "False",
                "Degraded": "False",
                "ConfigValid": "True",
                "SizingValid": "Unknown",
            }
            assert all(c["observedGeneration"] == 1 and c["reason"] for c in st["conditions"])
            grp = group(api)
            assert grp["leader"] == {
                "node": "node-a",
                "ppRank": 0,
                "fanoutEndpoint": grp["members"][0]["fanoutEndpoint"],
            }
            assert grp["epoch"] == 1 and grp["phase"] == "Ready" and grp["memberCount"] == 2
            assert api.stored(GROUPS, NS, "pool-r0")["metadata"]["ownerReferences"][0]["uid"] == uid  # type: ignore[index]
            assert "LeaderElected" in event_reasons(api)
            # No finalizer and no kopf bookkeeping on the pool: nothing lives outside the cluster.
            meta = pool(api)["metadata"]
            assert not meta.get("finalizers")
            assert not [k for k in meta.get("annotations") or {} if "kopf" in k]


async def test_spec_update_rolls_agents_and_cache_epoch_does_not(api: ApiServer) -> None:
    async with running_operator(api):
        await api.create_object(POOLS, pool_manifest(**FAST))
        await wait_for_async(lambda: api.stored(DAEMONSETS, NS, "pool-agent"), "DaemonSet", 10)

        def template_hash() -> str:
            ds = api.stored(DAEMONSETS, NS, "pool-agent") or {}
            return str(ds["spec"]["template"]["metadata"]["annotations"][ANNOTATION_CONFIG_HASH])

        def agent_yaml() -> dict[str, Any]:
            cm = api.stored("v1/configmaps", NS, "pool-agent-config") or {}
            return dict(yaml.safe_load(cm["data"]["agent.yaml"]))

        first = template_hash()
        await wait_for_async(lambda: status(api).get("cacheEpoch") == 0, "first status", 10)
        await api.patch_object(POOLS, "pool", {"spec": {"cacheEpoch": 5}})
        await wait_for_async(
            lambda: agent_yaml()["cacheEpoch"] == 5, "cacheEpoch in the ConfigMap", 10
        )
        assert template_hash() == first  # agents re-read the file; no restart
        await wait_for_async(lambda: status(api).get("cacheEpoch") == 5, "status.cacheEpoch", 10)

        await api.patch_object(
            POOLS, "pool", {"spec": {"tokensPerBlock": 32, "agent": {"image": "img:2"}}}
        )
        await wait_for_async(lambda: template_hash() != first, "DaemonSet template change", 10)
        ds = api.stored(DAEMONSETS, NS, "pool-agent") or {}
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == "img:2"
        assert agent_yaml()["tokensPerBlock"] == 32
        await wait_for_async(
            lambda: status(api).get("observedGeneration") == 3, "observedGeneration 3", 10
        )
        assert condition(api, "Progressing")["status"] == "True"
        await wait_for_async(lambda: "CacheFlush" in event_reasons(api), "CacheFlush event", 5)


async def test_deleted_pool_is_forgotten_and_children_are_not_recreated(api: ApiServer) -> None:
    async with running_operator(api):
        await api.create_object(POOLS, pool_manifest(**FAST))
        await wait_for_async(lambda: api.names(DAEMONSETS, NS) == ["pool-agent"], "DaemonSet", 10)
        await api.delete_object(POOLS, "pool")
        # The emulated garbage collector removes the owned children.
        await wait_for_async(
            lambda: all(api.names(plural, NS) == [] for plural in CHILDREN), "collection", 10
        )
        agent = FakeAgent(api, "pool", "node-a", [{"replica": "r0", "ppRank": 0, "ppSize": 1}])
        await agent.start()  # a lease of the deleted pool must not revive it
        await agent.beat()
        # A pool created after the Lease: once its children exist, the operator has
        # moved past the Lease's events.
        await api.create_object(POOLS, pool_manifest("later", **FAST))
        await wait_for_async(
            lambda: api.names(DAEMONSETS, NS) == ["later-agent"], "the later pool's DaemonSet", 10
        )
        assert all(not of_pool(api.names(plural, NS), "pool") for plural in CHILDREN)
        assert of_pool(api.names(GROUPS, NS), "pool") == []


def of_pool(names: list[str], pool: str) -> list[str]:
    """The names among ``names`` that belong to ``pool`` (they start with its name)."""
    return [name for name in names if name.startswith(f"{pool}-")]


async def test_lost_leader_is_replaced_with_a_higher_epoch_in_time(api: ApiServer) -> None:
    agents = await start_group(api, ["node-a", "node-b", "node-c"])
    async with running_operator(api), heartbeating(agents, 0.25) as alive:
        await api.create_object(POOLS, pool_manifest(**FAST))
        await wait_for_async(
            lambda: group(api).get("leader", {}).get("node") == "node-a", "first leader", 10
        )
        epoch = group(api)["epoch"]
        alive["node-a"] = False
        new = await wait_for_async(
            lambda: (
                group(api)
                if (group(api).get("leader") or {}).get("node", "node-a") != "node-a"
                else None
            ),
            "new leader",
            LEASE + RETRY + 5,
        )
        assert new["leader"]["node"] == "node-b" and new["leader"]["ppRank"] == 1
        assert new["epoch"] == epoch + 1 and new["lastFailover"]
        assert {m["node"]: m["ready"] for m in new["members"]} == {
            "node-a": False,
            "node-b": True,
            "node-c": True,
        }
        assert new["phase"] == "Degraded"
        # No timed assertion here (a shared CI box is noisy): the wait above is bounded,
        # test_operator_controller proves on a fake clock that the reconcile runs exactly
        # at lease expiry, and bench/operator.py measures the failover time.
        await wait_for_async(lambda: "Failover" in event_reasons(api), "Failover event", 5)
        await wait_for_async(
            lambda: condition(api, "Degraded").get("status") == "True", "pool Degraded", 5
        )


def leaders_by_epoch(api: ApiServer, name: str = "pool-r0") -> dict[int, set[str]]:
    history = api.objects[kmock.resource(GROUPS), NS, name].history
    seen: dict[int, set[str]] = {}
    for version in history:
        if version is None:
            continue
        st = version.raw.get("status") or {}
        if "epoch" in st:
            seen.setdefault(st["epoch"], set()).add((st.get("leader") or {}).get("node", "-"))
    return seen


async def test_two_racing_operators_never_publish_two_leaders_for_one_epoch(api: ApiServer) -> None:
    agents = await start_group(api, ["node-a", "node-b", "node-c", "node-d"])
    async with (
        running_operator(api, "op-a"),
        running_operator(api, "op-b"),
        heartbeating(agents, 0.25) as alive,
    ):
        await api.create_object(POOLS, pool_manifest(**FAST))
        await wait_for_async(
            lambda: group(api).get("leader", {}).get("node") == "node-a", "first leader", 10
        )
        for lost in ("node-a", "node-b"):
            alive[lost] = False

            def replaced(lost: str = lost) -> bool:
                return (group(api).get("leader") or {}).get("node") not in (lost, None)

            await wait_for_async(
                replaced,
                f"leader after losing {lost}",
                LEASE + RETRY + 8,
            )
    # The race really happened: conditional group writes were refused with 409 and
    # the losing operator re-read and decided again.
    assert api.conflicts > 0, "no conditional write conflicted; the race was not exercised"
    by_epoch = leaders_by_epoch(api)
    assert all(len(leaders) == 1 for leaders in by_epoch.values()), by_epoch
    epochs = sorted(by_epoch)
    assert epochs == list(range(1, epochs[-1] + 1))  # never skips back, never decreases
    assert by_epoch[epochs[-1]] == {"node-c"}
    electors = {
        (v.raw.get("status") or {}).get("electedBy")
        for v in api.objects[kmock.resource(GROUPS), NS, "pool-r0"].history
        if v is not None
    }
    assert electors - {None} <= {"op-a", "op-b"}


async def test_restart_resumes_without_duplicates_or_new_epochs(api: ApiServer) -> None:
    agents = await start_group(api, ["node-a", "node-b"])
    async with heartbeating(agents, BEAT):
        async with running_operator(api, "first"):
            await api.create_object(POOLS, pool_manifest(**FAST))
            await wait_for_async(lambda: group(api).get("epoch") == 1, "first election", 10)
            # Groups are published on their own timer: wait for the children as well.
            await wait_for_async(
                lambda: all(api.names(k, NS) == v for k, v in CHILDREN.items()), "children", 10
            )
        secret = api.stored("v1/secrets", NS, "pool-curve")
        ds_version = api.stored(DAEMONSETS, NS, "pool-agent")["metadata"]["resourceVersion"]  # type: ignore[index]
        creates_before = len(api[kmock.action.CREATE])
        # Only the operator lists groups (at the end of its first reconcile of a pool),
        # so a new list proves the second operator reconciled the pool itself.
        group_lists_before = group_lists(api)
        async with running_operator(api, "second"):
            await wait_for_async(
                lambda: group_lists(api) > group_lists_before, "the second operator's reconcile", 10
            )
            # Renewals for longer than one lease duration: nothing expires.
            beats = [agent.beats + int((LEASE + RETRY) / BEAT) for agent in agents]
            await wait_for_async(
                lambda: all(a.beats >= b for a, b in zip(agents, beats, strict=True)),
                "renewals past one lease duration",
                30,
            )
            assert group(api)["epoch"] == 1 and group(api)["leader"]["node"] == "node-a"
        assert api.stored("v1/secrets", NS, "pool-curve") == secret
        assert api.stored(DAEMONSETS, NS, "pool-agent")["metadata"]["resourceVersion"] == ds_version  # type: ignore[index]
        new_creates = [r for r in api[kmock.action.CREATE]][creates_before:]
        assert all(r.resource.plural == "events" for r in new_creates), [
            r.resource for r in new_creates
        ]
        for plural, names in CHILDREN.items():
            assert api.names(plural, NS) == names


def group_lists(api: ApiServer) -> int:
    return sum(
        1
        for r in api[kmock.action.LIST]
        if r.resource is not None and r.resource.plural == "kvcachegroups"
    )


async def test_api_errors_409_and_500_are_retried(api: ApiServer) -> None:
    faults = [
        api.fail(500, action="create", plural="daemonsets", times=2),
        api.fail(503, action="fetch", plural="configmaps", times=2),
        api.fail(409, action="update", plural="kvcachegroups", times=2),
        api.fail(500, action="update", plural="kvcachepools", times=1),
    ]
    agents = group_agents(api, ["node-a"])
    await agents[0].start()
    async with running_operator(api), heartbeating(agents, 0.25):
        await api.create_object(POOLS, pool_manifest(**FAST))
        await mark_rolled_out_when_present(api, 1)
        await wait_for_async(
            lambda: status(api).get("phase") == "Ready", "Ready despite faults", 15
        )
        assert group(api)["leader"]["node"] == "node-a" and group(api)["epoch"] == 1
    assert [f.hits for f in faults] == [2, 2, 2, 1]
    assert api.names(DAEMONSETS, NS) == ["pool-agent"]


async def mark_rolled_out_when_present(api: ApiServer, desired: int) -> None:
    await wait_for_async(lambda: api.stored(DAEMONSETS, NS, "pool-agent"), "DaemonSet", 15)
    await mark_rolled_out(api, desired)


async def test_bad_spec_is_reported_and_isolated(api: ApiServer) -> None:
    bad_timing = {
        "leaderElection": {
            "leaseDurationSeconds": 5,
            "renewDeadlineSeconds": 5,
            "retryPeriodSeconds": 2,
        }
    }
    async with running_operator(api):
        await api.create_object(POOLS, pool_manifest("bad", **bad_timing))
        await api.create_object(POOLS, pool_manifest("good", **FAST))
        await wait_for_async(
            lambda: condition(api, "ConfigValid", "bad").get("status") == "False",
            "ConfigValid=False",
            10,
        )
        message = condition(api, "ConfigValid", "bad")["message"]
        assert (
            "spec.leaderElection" in message
            and "leaseDurationSeconds (5) > renewDeadlineSeconds (5)" in message
        )
        assert status(api, "bad")["phase"] == "Invalid"
        await wait_for_async(
            lambda: api.stored(DAEMONSETS, NS, "good-agent"), "the good pool's children", 10
        )
        assert not any(
            n.startswith("bad-") for n in api.names("v1/configmaps", NS) + api.names(DAEMONSETS, NS)
        )
        assert "ConfigError" in event_reasons(api)

        # A bad update of a working pool leaves its children as they were.
        ds_before = api.stored(DAEMONSETS, NS, "good-agent")
        await api.patch_object(POOLS, "good", {"spec": {"tiers": {"cpu": {"size": "lots"}}}})
        await wait_for_async(
            lambda: condition(api, "ConfigValid", "good").get("status") == "False",
            "good turns invalid",
            10,
        )
        assert "spec.tiers.cpu.size" in condition(api, "ConfigValid", "good")["message"]
        assert api.stored(DAEMONSETS, NS, "good-agent") == ds_before

        # Fixing the spec creates the children.
        await api.patch_object(POOLS, "bad", {"spec": FAST})
        await wait_for_async(
            lambda: api.stored(DAEMONSETS, NS, "bad-agent"), "children after the fix", 10
        )
        await wait_for_async(
            lambda: condition(api, "ConfigValid", "bad").get("status") == "True", "valid again", 10
        )


async def test_curve_secret_is_generated_once_and_repaired_if_broken(api: ApiServer) -> None:
    async with running_operator(api):
        await api.create_object(POOLS, pool_manifest(**FAST))
        await wait_for_async(lambda: api.stored("v1/secrets", NS, "pool-curve"), "Secret", 10)
        original = api.stored("v1/secrets", NS, "pool-curve")
        public = base64.b64decode(original["data"]["curve-public.key"]).decode()  # type: ignore[index]
        assert len(public) == 40
        await api.patch_object(POOLS, "pool", {"spec": {"cacheEpoch": 1}})  # a reconcile
        await wait_for_async(lambda: status(api).get("cacheEpoch") == 1, "reconciled", 10)
        assert api.stored("v1/secrets", NS, "pool-curve") == original
        await corrupt_curve_secret(api)
        await api.patch_object(POOLS, "pool", {"spec": {"cacheEpoch": 2}})
        await wait_for_async(lambda: curve_secret_repaired(api), "repaired Secret", 10)

"""The remote tier on the operator's side: ``spec.tiers.remote`` rendered into agent.yaml,
and a pool's managed mooncake_master (Deployment and Service) created, owned by the
pool, kept as rendered, and removed when the pool turns it off, against the emulated
API server one reconcile at a time."""

from __future__ import annotations

import copy
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from flexkv_operator import crds, mooncake, names
from flexkv_operator.children import PoolIdentity, agent_config, render_all
from flexkv_operator.spec import ConfigInvalid, parse_pool_spec
from test_operator_crds import refusals

from tests.operator.flexkv_harness import pool_manifest
from tests.operator.reconcile_harness import ManualClock, reconcile, reconcile_context
from tests.support.kube_api import DAEMONSETS, NS, POOLS, ApiServer
from tests.support.waiting import wait_for, wait_for_async

DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
MASTER = "pool-mooncake-master"
MANAGED = {"cpu": {"size": "1Gi"}, "remote": {"mooncake": {"managed": True}}}
EXTERNAL_MOONCAKE = {
    "masterAddress": "10.0.0.5:50051",
    "metadataServer": "http://10.0.0.5:8080/metadata",
}


def stored(api: ApiServer, plural: str, name: str) -> dict[str, Any] | None:
    return api.stored(plural, NS, name)


def agent_yaml(api: ApiServer) -> dict[str, Any]:
    config_map = stored(api, "v1/configmaps", "pool-agent-config")
    assert config_map is not None
    return dict(yaml.safe_load(config_map["data"][names.CONFIG_KEY]))


def events(api: ApiServer, reason: str) -> list[dict[str, Any]]:
    found = [api.stored("v1/events", NS, n) or {} for n in api.names("v1/events", NS)]
    return [e for e in found if e.get("reason") == reason]


def condition(api: ApiServer, type_: str) -> dict[str, Any]:
    conditions = ((stored(api, POOLS, "pool") or {}).get("status") or {}).get("conditions")
    return next((dict(c) for c in conditions or [] if c["type"] == type_), {})


def master_container(api: ApiServer) -> dict[str, Any]:
    deployment = stored(api, DEPLOYMENTS, MASTER)
    assert deployment is not None
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


async def test_managed_master_is_created_owned_and_agents_point_at_it(api: ApiServer) -> None:
    pool = await api.create_object(POOLS, pool_manifest(tiers=MANAGED))
    async with reconcile_context(api, ManualClock()) as ctx:
        await reconcile(ctx, api)

    deployment = stored(api, DEPLOYMENTS, MASTER)
    service = stored(api, SERVICES, MASTER)
    assert deployment is not None and service is not None
    for child in (deployment, service):
        [owner] = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "KVCachePool",
            pool["metadata"]["uid"],
            True,
        )
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # The agents' Services and PDB select flexkv-agent pods: never the master.
    agent_selector = names.selector_labels("pool")
    assert not agent_selector.items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["automountServiceAccountToken"] is False

    container = master_container(api)
    assert container["image"] == "registry.example/flexkv:1.0", "the agent image"
    assert container["command"] == ["mooncake_master"]
    assert "--rpc_port=50051" in container["args"]
    assert "--enable_http_metadata_server=true" in container["args"]
    assert "--http_metadata_server_port=8080" in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["rpc"] == 50051 and ports["metadata"] == 8080
    assert container["readinessProbe"]["tcpSocket"] == {"port": "rpc"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metadata"}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}

    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("rpc", 50051, "rpc"),
        ("metadata", 8080, "metadata"),
    }

    remote = agent_yaml(api)["tiers"]["remote"]
    assert remote == {
        "writePolicy": "store",
        "queueBlocks": 1024,
        "timeoutSeconds": 2.0,
        "mooncake": {
            "masterAddress": f"{MASTER}.{NS}.svc:50051",
            "metadataServer": f"http://{MASTER}.{NS}.svc:8080/metadata",
            "protocol": "tcp",
            "deviceName": "",
            "segmentSize": "4Gi",
            "localBufferSize": "512Mi",
            "storePort": 17500,
        },
    }
    ds = stored(api, DAEMONSETS, "pool-agent")
    assert ds is not None
    [agent] = ds["spec"]["template"]["spec"]["containers"]
    # Mooncake's ports, both pinned by the agent: RPC on storePort, data on storePort + 1.
    assert {"name": "mooncake", "containerPort": 17500, "protocol": "TCP"} in agent["ports"]
    assert {"name": "mooncake-data", "containerPort": 17501, "protocol": "TCP"} in agent["ports"]
    # The default memory request covers the CPU tier, the segment and the buffer.
    expected = (1 << 30) + (4 << 30) + (512 << 20) + (512 << 20)
    assert int(agent["resources"]["requests"]["memory"]) == expected


async def test_master_drift_is_reverted_and_a_steady_pool_writes_nothing(api: ApiServer) -> None:
    await api.create_object(POOLS, pool_manifest(tiers=MANAGED))
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)
        clock.now += 1
        assert (await reconcile(ctx, api)).children_changed == 0, "converged"

        template = copy.deepcopy((stored(api, DEPLOYMENTS, MASTER) or {})["spec"]["template"])
        template["spec"]["containers"][0]["image"] = "someone/else:latest"
        template["spec"]["containers"][0]["args"] = ["--rpc_port=1"]
        await api.patch_object(DEPLOYMENTS, MASTER, {"spec": {"template": template, "replicas": 3}})
        await api.patch_object(
            SERVICES, MASTER, {"spec": {"selector": {names.LABEL_INSTANCE: "other"}}}
        )
        clock.now += 1
        result = await reconcile(ctx, api)
        assert result.children_changed == 2
        container = master_container(api)
        assert container["image"] == "registry.example/flexkv:1.0"
        assert container["args"] == mooncake.master_args()
        assert (stored(api, DEPLOYMENTS, MASTER) or {})["spec"]["replicas"] == 1
        selector = (stored(api, SERVICES, MASTER) or {})["spec"]["selector"]
        assert selector == mooncake.master_selector("pool")
        messages = " ".join(e["message"] for e in events(api, "DriftCorrected"))
        assert f"Deployment {MASTER}" in messages and f"Service {MASTER}" in messages

        # A spec change reaches the master: its resources.
        resources = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
        tiers = copy.deepcopy(MANAGED)
        tiers["remote"]["mooncake"]["master"] = {"resources": resources}
        await api.patch_object(POOLS, "pool", {"spec": {"tiers": tiers}})
        clock.now += 1
        await reconcile(ctx, api)
        assert master_container(api)["resources"] == resources


async def test_turning_managed_off_deletes_the_master_and_repoints_the_agents(
    api: ApiServer,
) -> None:
    await api.create_object(POOLS, pool_manifest(tiers=MANAGED))
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)
        assert stored(api, DEPLOYMENTS, MASTER) is not None

        # An existing master instead: the managed one goes, agents follow the addresses.
        mooncake_spec = {"managed": False, **EXTERNAL_MOONCAKE}
        external = {"spec": {"tiers": {"remote": {"mooncake": mooncake_spec}}}}
        await api.patch_object(POOLS, "pool", external)
        clock.now += 1
        result = await reconcile(ctx, api)
        assert result.errors == ()
        assert stored(api, DEPLOYMENTS, MASTER) is None
        assert stored(api, SERVICES, MASTER) is None
        assert stored(api, SERVICES, "pool-agents") is not None, "other Services stay"
        remote = agent_yaml(api)["tiers"]["remote"]["mooncake"]
        assert remote["masterAddress"] == "10.0.0.5:50051"
        assert remote["metadataServer"] == "http://10.0.0.5:8080/metadata"

        # Managed again, then no remote tier at all: the master comes and goes.
        await api.patch_object(
            POOLS,
            "pool",
            {
                "spec": {
                    "tiers": {
                        "remote": {
                            "mooncake": {
                                "managed": True,
                                "masterAddress": None,
                                "metadataServer": None,
                            }
                        }
                    }
                }
            },
        )
        clock.now += 1
        await reconcile(ctx, api)
        assert stored(api, DEPLOYMENTS, MASTER) is not None
        await api.patch_object(POOLS, "pool", {"spec": {"tiers": {"remote": None}}})
        clock.now += 1
        await reconcile(ctx, api)
        assert stored(api, DEPLOYMENTS, MASTER) is None and stored(api, SERVICES, MASTER) is None
        assert "remote" not in agent_yaml(api)["tiers"]
        ds = stored(api, DAEMONSETS, "pool-agent") or {}
        ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
        assert [p["name"] for p in ports] == ["http", "fanout"]
        clock.now += 1
        assert (await reconcile(ctx, api)).children_changed == 0, "nothing left to delete"


async def test_a_namesake_the_pool_does_not_own_is_left_alone(api: ApiServer) -> None:
    await api.create_object(POOLS, pool_manifest())
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": MASTER, "namespace": NS},
        "spec": {"selector": {"app": "someone-elses"}, "ports": [{"port": 1}]},
    }
    await api.create_object(SERVICES, foreign)
    async with reconcile_context(api, ManualClock()) as ctx:
        result = await reconcile(ctx, api)
    assert result.errors == ()
    assert (stored(api, SERVICES, MASTER) or {})["spec"]["selector"] == {"app": "someone-elses"}


async def test_deleting_the_pool_collects_the_master(api: ApiServer) -> None:
    await api.create_object(POOLS, pool_manifest(tiers=MANAGED))
    async with reconcile_context(api, ManualClock()) as ctx:
        await reconcile(ctx, api)
    assert stored(api, DEPLOYMENTS, MASTER) is not None
    await api.delete_object(POOLS, "pool")
    await wait_for_async(
        lambda: stored(api, DEPLOYMENTS, MASTER) is None and stored(api, SERVICES, MASTER) is None,
        "the master collected with its pool",
        10,
    )


async def test_a_refused_master_is_reported_and_the_rest_applied(api: ApiServer) -> None:
    refused = api.fail(422, action="create", plural="deployments", times=1000)
    await api.create_object(POOLS, pool_manifest(tiers=MANAGED))
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        result = await reconcile(ctx, api)
        assert result.errors == (f"Deployment {MASTER}: 422 injected 422",)
        degraded = condition(api, "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "ReconcileError"
        assert f"Deployment {MASTER}" in degraded["message"]
        [event] = events(api, "ReconcileError")
        assert event["type"] == "Warning" and f"Deployment {MASTER}" in event["message"]
        assert stored(api, SERVICES, MASTER) is not None
        assert stored(api, DAEMONSETS, "pool-agent") is not None, "the agents still roll out"
        errors = ctx.metrics.api_errors.labels("POST", "422")._value.get()
        assert errors >= 1

        refused.remaining = 0
        clock.now += 1
        result = await reconcile(ctx, api)
        assert result.errors == () and stored(api, DEPLOYMENTS, MASTER) is not None
        assert condition(api, "Degraded").get("reason") != "ReconcileError"


async def test_a_bad_remote_spec_is_reported_and_changes_nothing(api: ApiServer) -> None:
    await api.create_object(POOLS, pool_manifest(tiers=MANAGED))
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)
        before = stored(api, DEPLOYMENTS, MASTER)
        # Both a managed master and an address: the CRD refuses this; an older or
        # emulated API server may not, and the operator refuses it again.
        bad = {"remote": {"mooncake": {"managed": True, "masterAddress": "m:50051"}}}
        await api.patch_object(POOLS, "pool", {"spec": {"tiers": bad}})
        clock.now += 1
        result = await reconcile(ctx, api)
        assert result.phase == "Invalid"
        valid = condition(api, "ConfigValid")
        assert valid["status"] == "False"
        assert "spec.tiers.remote.mooncake" in valid["message"]
        assert "'m:50051'" in valid["message"]
        [event] = events(api, "ConfigError")
        assert "spec.tiers.remote.mooncake" in event["message"]
        assert stored(api, DEPLOYMENTS, MASTER) == before, "children left unchanged"


# -- rendering and spec checks, without an API server ---------------------------------

POOL = PoolIdentity("pool", NS, {"uid": "u", "name": "pool"})


def _spec(remote: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"tiers": {"cpu": {"size": "1Gi"}, "remote": remote}, **spec}


def test_an_external_master_renders_no_master_children() -> None:
    remote = {
        "writePolicy": "evict",
        "queueBlocks": 64,
        "timeoutSeconds": 0.5,
        "mooncake": {
            **EXTERNAL_MOONCAKE,
            "protocol": "rdma",
            "deviceName": "mlx5_0",
            "segmentSize": 1 << 30,
            "localBufferSize": "64Mi",
            "storePort": 18000,
        },
    }
    config = parse_pool_spec(_spec(remote), "img:1", name="pool")
    kinds = [(m["kind"], m["metadata"]["name"]) for m in render_all(POOL, config, "sa")]
    assert ("Deployment", MASTER) not in kinds and ("Service", MASTER) not in kinds
    assert agent_config(POOL, config)["tiers"]["remote"] == {
        "writePolicy": "evict",
        "queueBlocks": 64,
        "timeoutSeconds": 0.5,
        "mooncake": {
            "masterAddress": "10.0.0.5:50051",
            "metadataServer": "http://10.0.0.5:8080/metadata",
            "protocol": "rdma",
            "deviceName": "mlx5_0",
            "segmentSize": 1 << 30,
            "localBufferSize": "64Mi",
            "storePort": 18000,
        },
    }


def test_no_remote_tier_renders_no_remote_section() -> None:
    config = parse_pool_spec({"tiers": {"cpu": {"size": "1Gi"}}}, "img:1")
    assert config.remote is None and "remote" not in agent_config(POOL, config)["tiers"]


BAD_REMOTE = [
    ("neither managed nor addresses", _spec({"mooncake": {}}), "tiers.remote.mooncake"),
    (
        "only a master address",
        _spec({"mooncake": {"masterAddress": "m:50051"}}),
        "tiers.remote.mooncake",
    ),
    (
        "managed and an address",
        _spec({"mooncake": {"managed": True, "metadataServer": "http://m:8080/metadata"}}),
        "tiers.remote.mooncake",
    ),
    (
        "address without a port",
        _spec({"mooncake": {"masterAddress": "m", "metadataServer": "P2PHANDSHAKE"}}),
        "tiers.remote.mooncake.masterAddress",
    ),
    (
        "address port out of range",
        _spec({"mooncake": {"masterAddress": "m:70000", "metadataServer": "P2PHANDSHAKE"}}),
        "tiers.remote.mooncake.masterAddress",
    ),
    (
        "metadata server not a URL",
        _spec({"mooncake": {"masterAddress": "m:1", "metadataServer": "m:8080"}}),
        "tiers.remote.mooncake.metadataServer",
    ),
    (
        "unknown protocol",
        _spec({"mooncake": {"managed": True, "protocol": "udp"}}),
        "tiers.remote.mooncake.protocol",
    ),
    (
        "device with tcp",
        _spec({"mooncake": {"managed": True, "deviceName": "mlx5_0"}}),
        "tiers.remote.mooncake.deviceName",
    ),
    (
        "segment of zero bytes",
        _spec({"mooncake": {"managed": True, "segmentSize": "0Gi"}}),
        "tiers.remote.mooncake.segmentSize",
    ),
    (
        "segment below Mooncake's 16Mi",
        _spec({"mooncake": {"managed": True, "segmentSize": "8Mi"}}),
        "tiers.remote.mooncake.segmentSize",
    ),
    (
        "segment one byte below 16Mi",
        _spec({"mooncake": {"managed": True, "segmentSize": 16777215}}),
        "tiers.remote.mooncake.segmentSize",
    ),
    (
        "staging buffer of 1Ti",
        _spec({"mooncake": {"managed": True, "localBufferSize": "1Ti"}}),
        "tiers.remote.mooncake.localBufferSize",
    ),
    (
        "staging buffer below 1Mi",
        _spec({"mooncake": {"managed": True, "localBufferSize": 524288}}),
        "tiers.remote.mooncake.localBufferSize",
    ),
    (
        "store port in the ephemeral range",
        _spec({"mooncake": {"managed": True, "storePort": 40000}}),
        "tiers.remote.mooncake.storePort",
    ),
    (
        "data port at the start of the ephemeral range",
        _spec({"mooncake": {"managed": True, "storePort": 32767}}),
        "tiers.remote.mooncake.storePort",
    ),
    (
        "store port below 1024",
        _spec({"mooncake": {"managed": True, "storePort": 1000}}),
        "tiers.remote.mooncake.storePort",
    ),
    (
        "buffer not a quantity",
        _spec({"mooncake": {"managed": True, "localBufferSize": "lots"}}),
        "tiers.remote.mooncake.localBufferSize",
    ),
    (
        "store port out of range",
        _spec({"mooncake": {"managed": True, "storePort": 0}}),
        "tiers.remote.mooncake.storePort",
    ),
    (
        "store port 65535 leaves no data port",
        _spec({"mooncake": {"managed": True, "storePort": 65535}}),
        "tiers.remote.mooncake.storePort",
    ),
    (
        "store port on the agent's http port",
        _spec({"mooncake": {"managed": True, "storePort": 8080}}),
        "tiers.remote.mooncake.storePort",
    ),
    (
        "data port (store port + 1) on the agent's http port",
        _spec({"mooncake": {"managed": True, "storePort": 8079}}),
        "tiers.remote.mooncake.storePort",
    ),
    (
        "data port (store port + 1) on the agent's fanout port",
        _spec({"mooncake": {"managed": True, "storePort": 5556}}),
        "tiers.remote.mooncake.storePort",
    ),
    (
        "data port on a moved fanout port",
        _spec(
            {"mooncake": {"managed": True, "storePort": 18000}},
            agent={"ports": {"fanout": 18001}},
        ),
        "tiers.remote.mooncake.storePort",
    ),
    (
        "zero timeout",
        _spec({"timeoutSeconds": 0, "mooncake": {"managed": True}}),
        "tiers.remote.timeoutSeconds",
    ),
    (
        "timeout not inside the engine call",
        _spec({"timeoutSeconds": 10, "mooncake": {"managed": True}}),
        "tiers.remote.timeoutSeconds",
    ),
    (
        "unknown write policy",
        _spec({"writePolicy": "always", "mooncake": {"managed": True}}),
        "tiers.remote.writePolicy",
    ),
    (
        "empty queue",
        _spec({"queueBlocks": 0, "mooncake": {"managed": True}}),
        "tiers.remote.queueBlocks",
    ),
    (
        "master settings for an external master",
        _spec({"mooncake": {**EXTERNAL_MOONCAKE, "master": {"resources": {}}}}),
        "tiers.remote.mooncake.master",
    ),
    (
        "master request above its limit",
        _spec(
            {
                "mooncake": {
                    "managed": True,
                    "master": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}},
                }
            }
        ),
        "tiers.remote.mooncake.master.resources",
    ),
]


@pytest.mark.parametrize(
    ("spec", "field"), [(s, f) for _, s, f in BAD_REMOTE], ids=[n for n, _, _ in BAD_REMOTE]
)
def test_the_operator_refuses_bad_remote_specs_naming_the_field(
    spec: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigInvalid) as caught:
        parse_pool_spec(spec, "img:1", name="pool")
    assert [p.field for p in caught.value.problems] == [field], caught.value.problems


def test_mooncake_size_errors_name_the_setting_and_the_bound() -> None:
    def problem(key: str, value: object) -> str:
        spec = _spec({"mooncake": {"managed": True, key: value}})
        with pytest.raises(ConfigInvalid) as caught:
            parse_pool_spec(spec, "img:1", name="pool")
        [p] = caught.value.problems
        return str(p)

    assert "segmentSize: 8388608 bytes is below 16Mi (16777216)" in problem("segmentSize", "8Mi")
    huge = problem("localBufferSize", "1Ti")
    assert "localBufferSize: 1099511627776 bytes" in huge and "64Gi" in huge
    for doc, bound in (
        (_pool_doc(_spec({"mooncake": {"managed": True, "segmentSize": "8Mi"}})), "at least 16Mi"),
        (
            _pool_doc(_spec({"mooncake": {"managed": True, "localBufferSize": "1Ti"}})),
            "between 1Mi and 64Gi",
        ),
    ):
        [cel] = refusals(crds.POOL_PLURAL, doc)
        assert bound in cel
    for ok in ("16Mi", 16777216):
        spec = _spec({"mooncake": {"managed": True, "segmentSize": ok, "localBufferSize": "64Gi"}})
        assert refusals(crds.POOL_PLURAL, _pool_doc(spec)) == []
        assert parse_pool_spec(spec, "img:1", name="pool").remote is not None


def test_a_managed_master_needs_a_pool_name_its_service_can_carry() -> None:
    spec = _spec({"mooncake": {"managed": True}})
    parse_pool_spec(spec, "img:1", name="p" * names.MAX_MANAGED_MASTER_POOL_NAME)
    with pytest.raises(ConfigInvalid, match="at most 47"):
        parse_pool_spec(spec, "img:1", name="p" * (names.MAX_MANAGED_MASTER_POOL_NAME + 1))
    assert len(names.mooncake_master_name("p" * 47)) == 63


# -- the CRD (schema and CEL, as the API server checks them) agrees ---------------------


@pytest.mark.parametrize("spec", [s for _, s, _ in BAD_REMOTE], ids=[n for n, _, _ in BAD_REMOTE])
def test_the_crd_refuses_what_the_operator_refuses(spec: dict[str, Any]) -> None:
    doc = {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "pool"},
        "spec": copy.deepcopy(spec),
    }
    assert refusals(crds.POOL_PLURAL, doc) != []


GOOD_REMOTE = [
    ("managed with defaults", _spec({"mooncake": {"managed": True}})),
    ("external master", _spec({"mooncake": dict(EXTERNAL_MOONCAKE)})),
    (
        "peer-to-peer handshake over rdma",
        _spec(
            {
                "writePolicy": "evict",
                "mooncake": {
                    "masterAddress": "[fd00::5]:50051",
                    "metadataServer": "P2PHANDSHAKE",
                    "protocol": "rdma",
                    "deviceName": "mlx5_0,mlx5_1",
                    "segmentSize": 8589934592,
                    "localBufferSize": "1e9",
                    "storePort": 65534,
                },
            }
        ),
    ),
    (
        "managed master with resources",
        _spec(
            {
                "timeoutSeconds": 0.25,
                "mooncake": {
                    "managed": True,
                    "master": {"resources": {"requests": {"cpu": "1"}, "limits": {"cpu": 2}}},
                },
            }
        ),
    ),
]


@pytest.mark.parametrize("spec", [s for _, s in GOOD_REMOTE], ids=[n for n, _ in GOOD_REMOTE])
def test_the_crd_and_the_operator_accept_valid_remote_specs(spec: dict[str, Any]) -> None:
    doc = {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "pool"},
        "spec": copy.deepcopy(spec),
    }
    assert refusals(crds.POOL_PLURAL, doc) == []
    assert parse_pool_spec(spec, "img:1", name="pool").remote is not None


def _pool_doc(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "pool"},
        "spec": copy.deepcopy(spec),
    }


def _store_port_problem(store_port: int) -> str:
    spec = _spec({"mooncake": {"managed": True, "storePort": store_port}})
    with pytest.raises(ConfigInvalid) as caught:
        parse_pool_spec(spec, "img:1", name="pool")
    [problem] = caught.value.problems
    assert problem.field == "tiers.remote.mooncake.storePort"
    return problem.message


def test_store_port_errors_name_the_value_the_data_port_and_the_fix() -> None:
    """storePort + 1 is the agent's Mooncake data port: it must be a port and must not
    land on agent.ports; the operator and the CRD's CEL rule say which port collides."""
    top = _store_port_problem(65535)
    assert "65535" in top and "61000..65534" in top and "storePort + 1" in top
    ephemeral = _store_port_problem(40000)
    assert "40000" in ephemeral and "32768..60999" in ephemeral and "17500" in ephemeral
    data = _store_port_problem(8079)
    assert "8079" in data and "8080" in data and "data port" in data
    assert "next port" in data, "the fix"
    rpc = _store_port_problem(5557)
    assert "5557" in rpc and "fanout 5557" in rpc

    [cel] = refusals(
        crds.POOL_PLURAL, _pool_doc(_spec({"mooncake": {"managed": True, "storePort": 8079}}))
    )
    assert "storePort + 1" in cel and "agent.ports.http" in cel and "next port" in cel
    [bound] = refusals(
        crds.POOL_PLURAL, _pool_doc(_spec({"mooncake": {"managed": True, "storePort": 65535}}))
    )
    assert "65534" in bound
    [moved] = refusals(
        crds.POOL_PLURAL, _pool_doc(_spec({"mooncake": {"managed": True, "storePort": 40000}}))
    )
    assert "32768..60999" in moved

    # Just above the agent's ports, and the highest port with a data port, are fine.
    for ok in (8081, 5558, 65534):
        spec = _spec({"mooncake": {"managed": True, "storePort": ok}})
        assert refusals(crds.POOL_PLURAL, _pool_doc(spec)) == [], ok
        remote = parse_pool_spec(spec, "img:1", name="pool").remote
        assert remote is not None and remote.store_port == ok


def test_the_crd_refuses_a_managed_master_for_a_long_pool_name() -> None:
    doc = {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "p" * 48},
        "spec": _spec({"mooncake": {"managed": True}}),
    }
    assert any("at most 47" in v for v in refusals(crds.POOL_PLURAL, doc))
    doc["metadata"]["name"] = "p" * 47
    assert refusals(crds.POOL_PLURAL, doc) == []
    doc["metadata"]["name"] = "p" * 48
    doc["spec"] = _spec({"mooncake": dict(EXTERNAL_MOONCAKE)})
    assert refusals(crds.POOL_PLURAL, doc) == [], "an external master needs no Service"


def test_every_remote_field_is_described() -> None:
    remote = crds.schema(crds.POOL_PLURAL)["properties"]["spec"]["properties"]["tiers"][
        "properties"
    ]["remote"]
    mooncake_fields = remote["properties"]["mooncake"]["properties"]
    assert set(remote["properties"]) == {"writePolicy", "queueBlocks", "timeoutSeconds", "mooncake"}
    assert set(mooncake_fields) == {
        "managed",
        "masterAddress",
        "metadataServer",
        "protocol",
        "deviceName",
        "segmentSize",
        "localBufferSize",
        "storePort",
        "master",
    }
    for field in (remote, *remote["properties"].values(), *mooncake_fields.values()):
        assert field.get("description"), field


# -- the rendered flags against the real mooncake_master ---------------------------------


def _mooncake_master() -> str | None:
    """The wheel's ``mooncake_master`` (the ``remote`` extra): next to this interpreter,
    on PATH, or named by FLEXKV_MOONCAKE_MASTER."""
    here = Path(sys.executable).parent / "mooncake_master"
    named = os.environ.get("FLEXKV_MOONCAKE_MASTER")
    for candidate in (named, str(here) if here.exists() else None, shutil.which("mooncake_master")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_the_rendered_master_command_runs_the_real_mooncake_master(tmp_path: Path) -> None:
    """The Deployment's command and flags start a real mooncake_master whose ports answer
    the probes; only the ports are moved (later gflags win) to free loopback ones."""
    binary = _mooncake_master()
    if binary is None:
        pytest.skip("mooncake_master not installed (the remote extra); set FLEXKV_MOONCAKE_MASTER")
    config = parse_pool_spec(_spec({"mooncake": {"managed": True}}), "img:1", name="pool")
    [container] = mooncake.render_master_deployment("pool", NS, {}, config)["spec"]["template"][
        "spec"
    ]["containers"]
    assert container["command"] == ["mooncake_master"]
    rpc, metadata, metrics = _free_ports(3)
    moved = [
        "--rpc_address=127.0.0.1",
        f"--rpc_port={rpc}",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={metadata}",
        f"--metrics_port={metrics}",
    ]
    log = tmp_path / "master.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [binary, *container["args"], *moved],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
        answered: list[bool] = []

        def up_or_exited() -> bool:
            """True once the master answers on both ports (``answered`` holds whether
            /health said 200) or has exited."""
            if process.poll() is not None:
                return True
            try:
                with socket.create_connection(("127.0.0.1", rpc), timeout=1):
                    pass
                url = f"http://127.0.0.1:{metadata}/health"
                with urllib.request.urlopen(url, timeout=2) as answer:
                    answered.append(answer.status == 200)
            except OSError:
                return False
            return True

        try:
            wait_for(up_or_exited, "mooncake_master's ports", timeout=60, interval=0.2)
            assert process.poll() is None, f"mooncake_master exited: {log.read_text()[-2000:]}"
            assert answered == [True], f"no /health on the metadata port: {log.read_text()[-2000:]}"
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
    text = log.read_text()
    assert "unknown command line flag" not in text
    assert "HTTP metadata cleanup on client timeout: enabled" in text

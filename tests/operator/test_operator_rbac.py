"""The operator's RBAC is exactly what it uses: every request the real operator (kopf
and its own client) sends to the emulated API server during a full lifecycle is
checked against the Role and ClusterRole that ``helm template`` renders, and every
verb those grant is used at least once.

Requests map to RBAC verbs as the API server maps them: GET on a name is ``get``,
GET on a collection ``list``, ``?watch`` ``watch``, POST ``create``, PATCH
``patch``, PUT ``update``, DELETE on a name ``delete`` (on a collection
``deletecollection``). The test's own requests (kmock's client) are told apart
by their User-Agent.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from flexkv_operator import names

from tests.operator.flexkv_harness import (
    FAST,
    FakeAgent,
    corrupt_curve_secret,
    curve_secret_repaired,
    heartbeating,
    pool_manifest,
    running_operator,
)
from tests.operator.reconcile_harness import add_node
from tests.support.kube_api import DAEMONSETS, GROUPS, LEASES, NS, POOLS, ApiServer
from tests.support.waiting import wait_for_async

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "flexkv-operator"
RELEASE = "kv"
OPERATOR_AGENTS = ("kopf/", "flexkv-operator")
DEPLOYMENTS = "apps/v1/deployments"

Permission = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)


def helm_binary() -> str:
    found = shutil.which("helm")
    local = REPO / ".tools" / "bin" / "helm"
    if found is None and local.is_file() and os.access(local, os.X_OK):
        found = str(local)
    if found is None:
        pytest.skip("helm binary not found on PATH or in .tools/bin (run `make test` to fetch it)")
    return found


def rendered_rules() -> tuple[set[Permission], set[Permission]]:
    """(namespaced grants of the operator Role in NS, cluster-wide grants)."""
    proc = subprocess.run(
        [helm_binary(), "template", RELEASE, str(CHART), "--namespace", NS],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    fullname = f"{RELEASE}-flexkv-operator"

    def grants(kind: str, name: str) -> set[Permission]:
        (role,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert role["metadata"].get("namespace", NS) == NS
        return {
            (group, resource, verb)
            for rule in role["rules"]
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        }

    # The release namespace is NS here, so the leader-election Role applies there too.
    role = grants("Role", f"{fullname}-operator") | grants(
        "Role", f"{fullname}-operator-leader-election"
    )
    return role, grants("ClusterRole", f"{fullname}-operator-cluster")


def rbac_verb(request: kmock.Request) -> str:
    method = str(getattr(request.method, "value", request.method)).upper()
    watching = str(request.params.get("watch", "")).lower() in ("1", "true")
    if request.action == kmock.action.WATCH or (method == "GET" and watching):
        return "watch"
    if method == "GET":
        return "get" if request.name else "list"
    if method == "DELETE":
        return "delete" if request.name else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}[method]


def operator_requests(api: ApiServer) -> list[tuple[Permission, bool, str]]:
    """(permission, namespaced request, description) of each operator request."""
    found = []
    for request in list(api):
        agent = str(request.headers.get("User-Agent", ""))
        if not agent.startswith(OPERATOR_AGENTS):
            continue  # the test's own requests
        if request.resource is None or not request.resource.plural:
            continue  # API discovery: allowed to every authenticated user
        resource = request.resource.plural
        if request.subresource:
            resource = f"{resource}/{request.subresource}"
        permission = (request.resource.group or "", resource, rbac_verb(request))
        found.append((permission, request.namespace is not None, f"{request.method} {request.url}"))
    return found


async def test_every_operator_request_is_granted_and_every_grant_is_used(
    api: ApiServer,
) -> None:
    role, cluster = rendered_rules()
    for node in ("node-a", "node-b"):
        await add_node(api, node)
    agents = [
        FakeAgent(api, "pool", "node-a", [{"replica": "r0", "ppRank": 0, "ppSize": 2}]),
        FakeAgent(api, "pool", "node-b", [{"replica": "r0", "ppRank": 1, "ppSize": 2}]),
        FakeAgent(api, "pool", "node-x", [{"replica": "r1", "ppRank": 0, "ppSize": 1}]),
    ]
    for agent in agents:
        await agent.start()
    # All three Services refused in two reconciles: a ReconcileError Event, then the
    # same Event counted again.
    api.fail(422, action="create", plural="services", times=6)
    async with (
        running_operator(
            api,
            resync=2.0,
            node_cache_seconds=0.5,
            removed_node_lease_durations=1.0,
            leader_election=True,
            election_lease_duration=3.0,
            election_renew_deadline=2.0,
            election_retry_period=0.5,
        ),
        heartbeating(agents, 0.25) as alive,
    ):
        # A managed Mooncake master: its Deployment and Service are children too.
        remote = {"mooncake": {"managed": True}}
        await api.create_object(
            POOLS, pool_manifest(**FAST, tiers={"cpu": {"size": "1Gi"}, "remote": remote})
        )

        def group(name: str) -> dict[str, Any]:
            return api.stored(GROUPS, NS, name) or {}

        await wait_for_async(
            lambda: (group("pool-r0").get("status") or {}).get("leader") and group("pool-r1"),
            "both groups",
            15,
        )
        await wait_for_async(lambda: len(api.names("v1/services", NS)) == 3, "Services created", 15)
        # Every child is patched: image and maxUnavailable (DaemonSet, PDB), service
        # labels (Services), cacheEpoch (ConfigMap), a broken key pair (Secret), the
        # master's resources (Deployment).
        await api.patch_object(
            POOLS,
            "pool",
            {
                "spec": {
                    "cacheEpoch": 1,
                    "agent": {"image": "img:2", "maxUnavailable": 2},
                    "monitoring": {"serviceLabels": {"team": "kv"}},
                    "tiers": {
                        "remote": {
                            "mooncake": {"master": {"resources": {"requests": {"cpu": "200m"}}}}
                        }
                    },
                }
            },
        )
        await corrupt_curve_secret(api)
        await wait_for_async(
            lambda: (
                (api.stored("policy/v1/poddisruptionbudgets", NS, "pool-agent") or {})
                .get("spec", {})
                .get("maxUnavailable")
                == 2
            ),
            "PDB patched",
            15,
        )
        await wait_for_async(lambda: curve_secret_repaired(api), "Secret repaired", 15)
        # node-x is not a node of the cluster: its silent Lease is deleted, and its
        # group with it.
        alive["node-x"] = False
        await wait_for_async(
            lambda: (
                names.lease_name("node-x") not in api.names(LEASES, NS)
                and "pool-r1" not in api.names(GROUPS, NS)
            ),
            "node-x's Lease and group deleted",
            20,
        )
        # A larger ppSize is patched into the group's spec.
        agents[1].memberships = [{"replica": "r0", "ppRank": 1, "ppSize": 3}]
        await wait_for_async(lambda: group("pool-r0")["spec"]["ppSize"] == 3, "ppSize patched", 15)
        ds = api.stored(DAEMONSETS, NS, "pool-agent") or {}
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == "img:2"
        await wait_for_async(
            lambda: (
                (api.stored(DEPLOYMENTS, NS, "pool-mooncake-master") or {})
                .get("spec", {})
                .get("template", {})
                .get("spec", {})
                .get("containers", [{}])[0]
                .get("resources", {})
                .get("requests", {})
                .get("cpu")
                == "200m"
            ),
            "master Deployment patched",
            15,
        )
        # The remote tier turned off: the master's Deployment and Service are deleted.
        await api.patch_object(POOLS, "pool", {"spec": {"tiers": {"remote": None}}})
        await wait_for_async(
            lambda: (
                "pool-mooncake-master" not in api.names(DEPLOYMENTS, NS)
                and "pool-mooncake-master" not in api.names("v1/services", NS)
            ),
            "master deleted",
            15,
        )
        # A group deleted by hand is re-created.
        old_uid = group("pool-r0")["metadata"]["uid"]
        await api.delete_object(GROUPS, "pool-r0")
        await wait_for_async(
            lambda: group("pool-r0").get("metadata", {}).get("uid") not in (None, old_uid),
            "group re-created",
            15,
        )
        assert base64.b64decode(
            (api.stored("v1/secrets", NS, "pool-curve") or {})["data"]["curve-public.key"]
        )

    requests = operator_requests(api)
    assert {agent for agent in OPERATOR_AGENTS} == {
        agent
        for agent in OPERATOR_AGENTS
        for r in api
        if str(r.headers.get("User-Agent", "")).startswith(agent)
    }, "both kopf and the operator's own client must have been seen"
    denied = sorted(
        {
            (permission, what)
            for permission, namespaced, what in requests
            if permission not in (cluster | role if namespaced else cluster)
        }
    )
    assert not denied, "requests the rendered operator RBAC does not allow:\n" + "\n".join(
        f"{p} <- {w}" for p, w in denied[:20]
    )
    used = {permission for permission, _, _ in requests}
    unused = sorted((role | cluster) - used)
    assert not unused, f"granted but never used by the operator: {unused}"

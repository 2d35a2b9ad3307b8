"""Drift: a hand edit of a field the operator renders (the agents' image, agent.yaml)
is reverted at the next reconcile, with a DriftCorrected Event; fields other
controllers, webhooks or the API server own are never fought over."""

from __future__ import annotations

import copy
from typing import Any

from flexkv_operator.apply import drifted_fields

from tests.operator.flexkv_harness import pool_manifest
from tests.operator.reconcile_harness import ManualClock, reconcile, reconcile_context
from tests.support.kube_api import DAEMONSETS, NS, POOLS, ApiServer

CONFIGMAPS = "v1/configmaps"


def ds(api: ApiServer) -> dict[str, Any]:
    found = api.stored(DAEMONSETS, NS, "pool-agent")
    assert found is not None
    return found


def events(api: ApiServer, reason: str) -> list[dict[str, Any]]:
    found = [api.stored("v1/events", NS, n) or {} for n in api.names("v1/events", NS)]
    return [e for e in found if e.get("reason") == reason]


async def test_hand_edits_are_reverted_and_foreign_fields_left_alone(api: ApiServer) -> None:
    await api.create_object(
        POOLS,
        pool_manifest(agent={"resources": {"requests": {"memory": "1024Mi", "cpu": "0.5"}}}),
    )
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)
        rendered_image = ds(api)["spec"]["template"]["spec"]["containers"][0]["image"]

        # What the API server, kubectl and other controllers add or normalise.
        template = copy.deepcopy(ds(api)["spec"]["template"])
        container = template["spec"]["containers"][0]
        container["terminationMessagePath"] = "/dev/termination-log"
        container["resources"]["requests"] = {"memory": "1Gi", "cpu": "500m"}
        for port in container.get("ports") or []:
            port["protocol"] = "TCP"
        template["spec"]["containers"].append({"name": "injected-sidecar", "image": "mesh:1"})
        template["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] = "now"
        await api.patch_object(
            DAEMONSETS,
            "pool-agent",
            {"spec": {"template": template, "revisionHistoryLimit": 10}},
        )
        version = ds(api)["metadata"]["resourceVersion"]
        clock.now += 1
        result = await reconcile(ctx, api)
        assert result.children_changed == 0
        assert ds(api)["metadata"]["resourceVersion"] == version, "nothing foreign was fought"
        assert events(api, "DriftCorrected") == []

        # A hand edit of the image: reverted, reported.
        edited = copy.deepcopy(ds(api)["spec"]["template"])
        edited["spec"]["containers"][0]["image"] = "someone/else:latest"
        await api.patch_object(DAEMONSETS, "pool-agent", {"spec": {"template": edited}})
        clock.now += 1
        result = await reconcile(ctx, api)
        live = ds(api)["spec"]["template"]
        assert live["spec"]["containers"][0]["image"] == rendered_image
        assert live["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] == "now"
        [event] = events(api, "DriftCorrected")
        assert event["type"] == "Warning" and "DaemonSet pool-agent" in event["message"]
        assert ".spec.template.spec.containers[0].image" in event["message"]

        # A hand edit of agent.yaml: reverted.
        config = api.stored(CONFIGMAPS, NS, "pool-agent-config")
        assert config is not None
        original = config["data"]["agent.yaml"]
        await api.patch_object(
            CONFIGMAPS, "pool-agent-config", {"data": {"agent.yaml": "pool: hacked\n"}}
        )
        clock.now += 1
        await reconcile(ctx, api)
        assert api.stored(CONFIGMAPS, NS, "pool-agent-config")["data"]["agent.yaml"] == original  # type: ignore[index]
        clock.now += 1
        assert (await reconcile(ctx, api)).children_changed == 0, "converged: no further writes"


def test_drift_is_judged_by_containment() -> None:
    want = {
        "a": {"b": 1, "none": None, "empty": [], "q": "1024Mi"},
        "l": [{"x": 1}],
        "s": "v",
    }
    same = {"a": {"b": 1, "q": "1Gi", "extra": 2}, "l": [{"x": 1, "y": 2}, {"z": 3}], "s": "v"}
    assert drifted_fields(want, same) == []
    assert drifted_fields(want, {**same, "s": "w"}) == [".s"]
    assert drifted_fields(want, {**same, "l": []}) == [".l"]
    assert drifted_fields(want, {**same, "a": {"b": 2, "q": "1Gi"}}) == [".a.b"]
    assert drifted_fields(want, {**same, "a": {"b": 1, "q": "2Gi"}}) == [".a.q"]
    assert drifted_fields(want, {**same, "a": {"b": 1, "q": "1Gi", "none": 5}}) == [".a.none"]
    assert drifted_fields({"flag": True}, {"flag": 1}) == [".flag"]
    assert drifted_fields({"port": 8080}, {"port": "8080"}) == []

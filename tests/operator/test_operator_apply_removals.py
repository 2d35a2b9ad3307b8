"""Keys removed from a pool's spec leave the live children: apply sends null for every
map key the last applied rendering had and the new one lacks."""

from __future__ import annotations

from typing import Any

from flexkv_operator.apply import ANNOTATION_LAST_APPLIED, removal_patch

from tests.operator.flexkv_harness import pool_manifest
from tests.operator.reconcile_harness import ManualClock, reconcile, reconcile_context
from tests.support.kube_api import DAEMONSETS, NS, POOLS, ApiServer


def live_pod(api: ApiServer) -> dict[str, Any]:
    ds = api.stored(DAEMONSETS, NS, "pool-agent") or {}
    return dict(ds["spec"]["template"])


async def test_dropped_node_selector_key_and_scrape_annotations_leave_the_daemonset(
    api: ApiServer,
) -> None:
    placement = {
        "nodeSelector": {"gpu": "h100", "zone": "a"},
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
    }
    spec = {"placement": placement, "monitoring": {"serviceLabels": {"team": "kv", "tier": "1"}}}
    await api.create_object(POOLS, pool_manifest(**spec))
    clock = ManualClock()
    async with reconcile_context(api, clock) as ctx:
        await reconcile(ctx, api)
        pod = live_pod(api)
        assert pod["spec"]["nodeSelector"] == {"gpu": "h100", "zone": "a"}
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        service = api.stored("v1/services", NS, "pool-agents") or {}
        labels = service["metadata"]["labels"]
        assert (labels["team"], labels["tier"]) == ("kv", "1")

        await api.patch_object(
            POOLS,
            "pool",
            {
                "spec": {
                    "placement": {"nodeSelector": {"zone": None}, "affinity": None},
                    "monitoring": {"scrapeAnnotations": False, "serviceLabels": {"tier": None}},
                }
            },
        )
        clock.now += 1
        await reconcile(ctx, api)

        pod = live_pod(api)
        assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
        assert "affinity" not in pod["spec"] or pod["spec"]["affinity"] is None
        annotations = pod["metadata"]["annotations"]
        assert not [k for k in annotations if k.startswith("prometheus.io/")], annotations
        service = api.stored("v1/services", NS, "pool-agents") or {}
        assert service["metadata"]["labels"].get("team") == "kv"
        assert "tier" not in service["metadata"]["labels"]
        ds = api.stored(DAEMONSETS, NS, "pool-agent") or {}
        assert ANNOTATION_LAST_APPLIED in ds["metadata"]["annotations"]


def test_removal_patch_nulls_removed_map_keys_at_any_depth_and_replaces_lists() -> None:
    last = {"a": {"b": 1, "c": {"d": 2, "e": 3}}, "l": [1, 2], "gone": {"x": 1}}
    new = {"a": {"b": 1, "c": {"d": 2}}, "l": [1]}
    assert removal_patch(last, new) == {
        "a": {"b": 1, "c": {"d": 2, "e": None}},
        "l": [1],
        "gone": None,
    }

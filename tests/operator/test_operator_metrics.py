"""The operator's own metrics and readiness: reconciles and errors by kind, reconcile
duration, failover latency, groups by phase, API errors, and a /readyz that fails
when the controller is not running or the agent Lease watch is stale."""

from __future__ import annotations

import socket
import urllib.request

import aiohttp
from flexkv_operator.metrics import OperatorMetrics, Readiness
from prometheus_client.parser import text_string_to_metric_families

from tests.operator.flexkv_harness import (
    FAST,
    heartbeating,
    pool_manifest,
    running_operator,
    start_group,
)
from tests.support.kube_api import GROUPS, NS, POOLS, ApiServer
from tests.support.waiting import wait_for_async


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def test_metrics_and_readiness_of_a_running_operator(api: ApiServer) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api.fail(422, action="create", plural="configmaps", times=1)
    agents = await start_group(api, ["node-a", "node-b"])
    async with (
        heartbeating(agents, 0.25) as alive,
        running_operator(api, metrics_port=port),
        aiohttp.ClientSession() as http,
    ):
        await api.create_object(POOLS, pool_manifest(**FAST))
        group = lambda: (api.stored(GROUPS, NS, "pool-r0") or {}).get("status") or {}  # noqa: E731
        await wait_for_async(
            lambda: (group().get("leader") or {}).get("node") == "node-a", "leader", 10
        )
        alive["node-a"] = False
        await wait_for_async(
            lambda: (group().get("leader") or {}).get("node") == "node-b", "failover", 15
        )

        def degraded_counted() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            """The scraped samples once the degraded group is counted, else nothing."""
            with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
                assert response.status == 200
                found = samples(response.read().decode())
            degraded = found.get(("flexkv_operator_groups", (("phase", "Degraded"),)))
            return found if degraded == 1.0 else {}

        found = await wait_for_async(degraded_counted, "the Degraded group counted", 10)
        assert (
            found[("flexkv_operator_reconciles_total", (("kind", "pool"), ("result", "success")))]
            >= 1
        )
        assert (
            found[("flexkv_operator_reconciles_total", (("kind", "pool"), ("result", "error")))]
            >= 1
        )
        assert (
            found[("flexkv_operator_reconciles_total", (("kind", "groups"), ("result", "success")))]
            >= 2
        )
        assert found[("flexkv_operator_reconcile_duration_seconds_count", (("kind", "pool"),))] >= 2
        assert found[("flexkv_operator_failover_latency_seconds_count", ())] == 1
        assert found[("flexkv_operator_failover_latency_seconds_sum", ())] >= 0
        assert found[("flexkv_operator_groups", (("phase", "Degraded"),))] == 1
        assert found[("flexkv_operator_groups", (("phase", "Ready"),))] == 0
        assert (
            found[("flexkv_operator_api_errors_total", (("method", "POST"), ("status", "422")))]
            == 1
        )
        assert found[("flexkv_operator_active", ())] == 1
        async with http.get(f"{base}/readyz") as response:
            assert response.status == 200


def test_readiness_fails_on_a_stale_lease_watch_or_a_stopped_controller() -> None:
    clock = [0.0]
    running = [True]
    tracked = [0]
    readiness = Readiness(
        clock=lambda: clock[0],
        controller_running=lambda: running[0],
        tracked_leases=lambda: tracked[0],
        stale_after=60,
    )
    assert readiness.problem() is None
    readiness.lease_event()
    tracked[0] = 3
    clock[0] = 59
    assert readiness.problem() is None
    clock[0] = 61
    assert "stale watch" in (readiness.problem() or "")
    readiness.lease_event()
    assert readiness.problem() is None
    tracked[0] = 0
    clock[0] = 1000
    assert readiness.problem() is None, "no agents: a quiet watch is not stale"
    running[0] = False
    assert "not running" in (readiness.problem() or "")


def test_group_phase_gauges_sum_over_pools_and_forget_deleted_pools() -> None:
    metrics = OperatorMetrics()
    metrics.set_group_phases(("ns", "a"), {"Ready": 2, "Degraded": 1})
    metrics.set_group_phases(("ns", "b"), {"Ready": 1})
    value = metrics.registry.get_sample_value
    assert value("flexkv_operator_groups", {"phase": "Ready"}) == 3
    metrics.set_group_phases(("ns", "a"), None)
    assert value("flexkv_operator_groups", {"phase": "Ready"}) == 1
    assert value("flexkv_operator_groups", {"phase": "Degraded"}) == 0

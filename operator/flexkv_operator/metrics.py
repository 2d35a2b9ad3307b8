"""The operator's own Prometheus metrics and its /metrics and /readyz endpoints.

Every operator instance has its own registry (tests run several in one process).
``/readyz`` answers 503 while this replica cannot be trusted to act: its
controller loop is not running, or its Lease watch is stale (agents are tracked
but no agent Lease event arrived for ``stale_after`` seconds, although live
agents renew every few seconds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

logger = logging.getLogger(__name__)

FAILOVER_BUCKETS = (0.5, 1, 2, 3, 5, 8, 10, 15, 20, 30, 45, 60, 120)


@dataclass
class OperatorMetrics:
    """The collectors; ``kind`` is ``pool`` (full reconcile) or ``groups`` (election)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.reconciles = Counter(
            "flexkv_operator_reconciles_total",
            "Reconciles by kind (pool, groups) and result (success, error)",
            ["kind", "result"],
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            "flexkv_operator_reconcile_duration_seconds",
            "Duration of one reconcile, by kind",
            ["kind"],
            registry=r,
        )
        self.failover_seconds = Histogram(
            "flexkv_operator_failover_latency_seconds",
            "From a group leader's Lease expiry (by the operator's clock) to its "
            "successor published",
            buckets=FAILOVER_BUCKETS,
            registry=r,
        )
        self.groups = Gauge(
            "flexkv_operator_groups",
            "KVCacheGroups by published phase (Pending, Ready, Degraded)",
            ["phase"],
            registry=r,
        )
        self.api_errors = Counter(
            "flexkv_operator_api_errors_total",
            "API requests answered with an error (after retries), by method and status "
            "(0: no answer)",
            ["method", "status"],
            registry=r,
        )
        self.active = Gauge(
            "flexkv_operator_active",
            "1 while this replica holds the operator Lease (or runs without election)",
            registry=r,
        )
        self._group_phases: dict[tuple[str, str], dict[str, int]] = {}
        for phase in ("Pending", "Ready", "Degraded"):
            self.groups.labels(phase).set(0)
        # Exported at 0 from the start: an alert on their increase sees the first error.
        for kind in ("pool", "groups"):
            self.reconciles.labels(kind, "success")
            self.reconciles.labels(kind, "error")

    def api_error(self, method: str, status: int) -> None:
        self.api_errors.labels(method, str(status)).inc()

    def set_group_phases(self, pool: tuple[str, str], phases: dict[str, int] | None) -> None:
        """The phases of one pool's groups (None: the pool is gone); gauges are the sums."""
        if phases is None:
            self._group_phases.pop(pool, None)
        else:
            self._group_phases[pool] = phases
        for phase in ("Pending", "Ready", "Degraded"):
            self.groups.labels(phase).set(
                sum(p.get(phase, 0) for p in self._group_phases.values())
            )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class Readiness:
    """Judges whether this replica's view of the cluster is current."""

    clock: Callable[[], float]
    controller_running: Callable[[], bool]
    tracked_leases: Callable[[], int]
    stale_after: float = 120.0
    last_lease_event: float | None = None

    def lease_event(self) -> None:
        self.last_lease_event = self.clock()

    def problem(self) -> str | None:
        """Why this replica is not ready, or None."""
        if not self.controller_running():
            return "the controller loop is not running"
        if self.tracked_leases() and self.last_lease_event is not None:
            silent = self.clock() - self.last_lease_event
            if silent > self.stale_after:
                return (
                    f"the agent Lease watch delivered nothing for {silent:.0f}s although "
                    f"{self.tracked_leases()} agents are tracked (stale watch)"
                )
        return None


async def serve(
    metrics: OperatorMetrics, readiness: Readiness, host: str, port: int
) -> web.AppRunner:
    """Serve GET /metrics and GET /readyz on ``host:port``; returns the runner to clean up."""

    async def metrics_handler(_: web.Request) -> web.Response:
        body = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def ready_handler(_: web.Request) -> web.Response:
        problem = readiness.problem()
        if problem is not None:
            return web.json_response({"ready": False, "reason": problem}, status=503)
        return web.json_response({"ready": True})

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/readyz", ready_handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    logger.info("Serving operator metrics", extra={"port": port})
    return runner

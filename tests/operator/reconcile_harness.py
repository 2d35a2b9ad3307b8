"""One reconcile at a time against the emulated API server, on a hand-moved clock.

The controller and kopf are left out: a test observes the agents' Leases as the
watch would (from the server's stored objects), moves the clock, and calls
:func:`flexkv_operator.reconcile.reconcile_pool` itself. Everything the reconcile
reads and writes goes over HTTP to the emulated server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from flexkv_operator.context import NodeCache, OperatorContext, OperatorSettings
from flexkv_operator.controller import Controller
from flexkv_operator.group_publisher import GroupCache
from flexkv_operator.kube import Connection, KubeClient
from flexkv_operator.membership import LeaseTracker
from flexkv_operator.reconcile import GroupSync, ReconcileResult, reconcile_pool

from tests.support.kube_api import LEASES, NS, POOLS, ApiServer


@dataclass
class ManualClock:
    """The operator's monotonic clock, moved only by the test."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def reconcile_context(
    api: ApiServer, clock: ManualClock, **settings: Any
) -> AsyncIterator[OperatorContext]:
    """An operator context talking to ``api``; nodes are re-listed at every reconcile."""
    async with KubeClient(Connection(server=str(api.url)), retries=1) as client:
        yield OperatorContext(
            client=client,
            settings=OperatorSettings(
                identity="op-test",
                default_image="registry.example/flexkv:1.0",
                service_account="flexkv-agent",
                **settings,
            ),
            clock=clock,
            tracker=LeaseTracker(clock=clock),
            nodes=NodeCache(ttl=0.0, clock=clock),
            groups=GroupCache(clock=clock, ttl=30.0),
        )


def observe_leases(ctx: OperatorContext, api: ApiServer, namespace: str = NS) -> None:
    """Feed every stored Lease to the tracker, as the Lease watch would."""
    for name in api.names(LEASES, namespace):
        lease = api.stored(LEASES, namespace, name)
        if lease is not None:
            ctx.tracker.observe(lease)


async def reconcile(ctx: OperatorContext, api: ApiServer, pool: str = "pool") -> ReconcileResult:
    """Observe the Leases, then reconcile ``pool`` once."""
    observe_leases(ctx, api)
    body = api.stored(POOLS, NS, pool)
    assert body is not None, f"pool {pool} is not stored"
    return await reconcile_pool(ctx, body)


async def add_node(api: ApiServer, name: str) -> None:
    response = await api.post(
        "/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
    )
    assert response.status < 300, await response.text()


def pool_event(name: str = "p", spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A KVCachePool body as the pool watch delivers it to the controller (``ns``)."""
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {"x": 1} if spec is None else spec,
    }


def lease_event(node: str, renew: str, ready: bool = True) -> dict[str, Any]:
    """An agent Lease of pool ``ns/p`` on ``node`` as the Lease watch delivers it;
    ``renew`` is both its renewTime and its resourceVersion (10 s lease)."""
    return {
        "metadata": {
            "name": f"flexkv-agent-{node}",
            "namespace": "ns",
            "resourceVersion": renew,
            "labels": {
                "app.kubernetes.io/name": "flexkv-agent",
                "flexkv.io/pool": "p",
                "flexkv.io/node": node,
            },
            "annotations": {
                "flexkv.io/ready": "true" if ready else "false",
                "flexkv.io/memberships": json.dumps([]),
            },
        },
        "spec": {"renewTime": renew, "leaseDurationSeconds": 10},
    }


async def no_groups(ctx: OperatorContext, body: dict[str, Any], relist: bool) -> GroupSync:
    """A group pass that publishes nothing and is due again in 30 s."""
    return GroupSync([], [], 30.0)


@dataclass
class GroupPassLog:
    """A group pass for :func:`running_controller` that records each pass as (loop
    seconds since ``start``, how many of pool ``ns/p``'s agents were fresh) and asks
    to run again when the first fresh Lease expires (in 30 s at the most)."""

    start: float
    passes: list[tuple[float, int]] = field(default_factory=list)

    async def __call__(self, ctx: OperatorContext, body: dict[str, Any], relist: bool) -> GroupSync:
        agents = ctx.tracker.agents("ns", "p", 10)
        now = asyncio.get_running_loop().time()
        self.passes.append((round(now - self.start, 3), sum(a.fresh for a in agents)))
        upcoming = [a.expires_at - ctx.clock() for a in agents if a.fresh]
        return GroupSync(agents, [], min([30.0, *upcoming]))


@dataclass
class ReconcileLog:
    """A reconciler for :func:`running_controller` that records when it ran (loop
    seconds since ``start``), fails its first ``failures`` calls and then asks to run
    again after ``requeue`` seconds."""

    start: float
    failures: int = 0
    requeue: float = 30.0
    times: list[float] = field(default_factory=list)

    async def __call__(self, ctx: OperatorContext, body: dict[str, Any]) -> ReconcileResult:
        self.times.append(round(asyncio.get_running_loop().time() - self.start, 3))
        if len(self.times) <= self.failures:
            raise RuntimeError("API unavailable")
        return ReconcileResult("Ready", self.requeue, 0, 0)


@contextlib.asynccontextmanager
async def running_controller(
    reconciler: Any, group_syncer: Any = no_groups
) -> AsyncIterator[Controller]:
    """The real :class:`Controller` on the test's event loop (looptime-friendly),
    driving ``reconciler`` and ``group_syncer`` instead of the API-backed ones."""
    loop = asyncio.get_running_loop()
    ctx = OperatorContext(
        client=KubeClient(Connection(server="http://127.0.0.1:9")),
        settings=OperatorSettings(identity="t", default_image="i", service_account="s"),
        clock=loop.time,
        tracker=LeaseTracker(clock=loop.time),
        nodes=NodeCache(ttl=60, clock=loop.time),
    )
    ctl = Controller(ctx, reconciler=reconciler, group_syncer=group_syncer)
    task = asyncio.create_task(ctl.run())
    try:
        yield ctl
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

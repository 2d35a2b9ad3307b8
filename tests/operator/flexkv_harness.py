"""Running the real operator (kopf in an asyncio task) against the emulated API,
and agents' heartbeat Leases written over HTTP the way agents write them."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import threading
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import kmock
import kopf
from flexkv_operator import names
from flexkv_operator.app import run_operator
from flexkv_operator.context import OperatorSettings
from flexkv_operator.kube import Connection

from tests.support.kube_api import LEASES, NS, ApiServer
from tests.support.waiting import wait_for_async

FAST = {
    "leaderElection": {
        "leaseDurationSeconds": 3,
        "renewDeadlineSeconds": 2,
        "retryPeriodSeconds": 1,
    }
}
"""Pool spec fragment: agent leases short enough for failover tests (3 s)."""


@contextlib.asynccontextmanager
async def running_operator(
    api: ApiServer,
    identity: str = "operator-a",
    *,
    image: str = "registry.example/flexkv:1.0",
    resync: float = 30.0,
    startup_timeout: float = 15.0,
    **extra_settings: Any,
) -> AsyncIterator[None]:
    """Run one operator instance in its own thread and event loop, as a separate
    process would be; stop it (bounded) on exit, even on failure.

    A thread of its own also keeps kopf's shutdown fast: kopf waits for every task
    created in its loop after startup, which would include the API server's."""
    stop = threading.Event()
    ready = threading.Event()
    errors: list[BaseException] = []
    settings = OperatorSettings(
        identity=identity,
        default_image=image,
        service_account="flexkv-agent",
        resync_seconds=resync,
        **extra_settings,
    )

    def target() -> None:
        try:
            asyncio.run(
                run_operator(
                    connection=Connection(server=str(api.url)),
                    login=kopf.ConnectionInfo(server=str(api.url)),
                    settings=settings,
                    namespaces=[NS],
                    stop_flag=stop,
                    ready_flag=ready,
                )
            )
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    before = watches_open(api)
    thread = threading.Thread(target=target, name=f"operator-{identity}", daemon=True)
    thread.start()
    try:
        await wait_for_async(lambda: ready.is_set() or errors, f"{identity} ready", startup_timeout)
        if errors:
            raise RuntimeError(f"operator {identity} failed to start") from errors[0]
        # kopf is "ready" before its watches are open; tests that time failovers
        # want the three watches (pools, leases, daemonsets) established.
        await wait_for_async(
            lambda: watches_open(api) >= before + 3, "three watches", startup_timeout
        )
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        if thread.is_alive():
            raise RuntimeError(f"operator {identity} did not stop within 15s")
    if errors:
        raise RuntimeError(f"operator {identity} failed") from errors[0]


def watches_open(api: ApiServer) -> int:
    return len(api[kmock.action.WATCH])


def pool_manifest(name: str = "pool", **spec: Any) -> dict[str, Any]:
    body_spec: dict[str, Any] = {"tiers": {"cpu": {"size": "1Gi"}}}
    body_spec.update(spec)
    return {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": body_spec,
    }


@dataclass
class FakeAgent:
    """Writes one agent's heartbeat Lease exactly as docs/contracts.md section 2 says."""

    api: ApiServer
    pool: str
    node: str
    memberships: list[dict[str, Any]] = field(default_factory=list)
    ready: bool = True
    cache_epoch: int = 0
    lease_duration: int = 3
    beats: int = 0
    owner: dict[str, Any] | None = None  # the agent pod, as the downward API names it

    def body(self) -> dict[str, Any]:
        ip = f"10.0.0.{abs(hash(self.node)) % 250 + 1}"
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": names.lease_name(self.node),
                "namespace": NS,
                "labels": {
                    names.LABEL_NAME: names.AGENT_APP,
                    names.LABEL_POOL: self.pool,
                    names.LABEL_NODE: self.node,
                },
                "annotations": {
                    names.ANNOTATION_ENDPOINTS: json.dumps(
                        {"http": f"{ip}:8080", "fanout": f"tcp://{ip}:5557"}
                    ),
                    names.ANNOTATION_MEMBERSHIPS: json.dumps(self.memberships),
                    names.ANNOTATION_TIERS: json.dumps(
                        {"cpu": {"capacityBytes": 1 << 30, "usedBytes": self.beats}}
                    ),
                    names.ANNOTATION_READY: "true" if self.ready else "false",
                    names.ANNOTATION_CACHE_EPOCH: str(self.cache_epoch),
                },
            },
            "spec": {
                "holderIdentity": f"{self.pool}-agent-{self.node}",
                "leaseDurationSeconds": self.lease_duration,
                "renewTime": now,
            },
        }
        if self.owner is not None:
            body["metadata"]["ownerReferences"] = [self.owner]
        return body

    async def start(self) -> None:
        await self.api.create_object(LEASES, self.body())

    async def beat(self) -> None:
        self.beats += 1
        await self.api.patch_object(LEASES, names.lease_name(self.node), self.body())


def group_agents(
    api: ApiServer,
    nodes: list[str],
    *,
    replica: str = "r0",
    pool: str = "pool",
    lease_duration: int = 3,
) -> list[FakeAgent]:
    """The agents of one PP group of ``pool``: stage ``i`` runs on ``nodes[i]``."""
    return [
        FakeAgent(
            api,
            pool,
            node,
            [{"replica": replica, "ppRank": rank, "ppSize": len(nodes)}],
            lease_duration=lease_duration,
        )
        for rank, node in enumerate(nodes)
    ]


async def start_group(api: ApiServer, nodes: list[str], **options: Any) -> list[FakeAgent]:
    """:func:`group_agents` (``options`` as there) with their Leases created."""
    agents = group_agents(api, nodes, **options)
    for agent in agents:
        await agent.start()
    return agents


@contextlib.asynccontextmanager
async def heartbeating(
    agents: list[FakeAgent], period: float, skip_refused: bool = False
) -> AsyncIterator[dict[str, bool]]:
    """Renew every agent's Lease each ``period`` while ``alive[node]`` is True.

    A refused renewal ends the loop with its error (raised on exit), unless
    ``skip_refused``: then it is skipped, as an agent retries its next renewal."""
    alive = {a.node: True for a in agents}

    async def beat(agent: FakeAgent) -> None:
        if not skip_refused:
            await agent.beat()
            return
        with contextlib.suppress(AssertionError):
            await agent.beat()

    async def loop() -> None:
        while True:
            await asyncio.gather(*(beat(a) for a in agents if alive[a.node]))
            await asyncio.sleep(period)

    task = asyncio.create_task(loop())
    try:
        yield alive
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


BROKEN_KEY = "AAAA"
"""What :func:`corrupt_curve_secret` writes over the pool's Curve secret key."""


async def corrupt_curve_secret(api: ApiServer, pool: str = "pool") -> None:
    """Overwrite the pool's Curve secret key, as a hand edit would."""
    body = {"data": {"curve-secret.key": BROKEN_KEY}}
    await api.patch_object("v1/secrets", f"{pool}-curve", body)


def curve_secret_repaired(api: ApiServer, pool: str = "pool") -> bool:
    """True once the pool's Curve Secret holds a key other than :data:`BROKEN_KEY`."""
    secret = api.stored("v1/secrets", NS, f"{pool}-curve") or {}
    return (secret.get("data") or {}).get("curve-secret.key") not in (None, BROKEN_KEY)


async def gather_bounded(*aws: Awaitable[Any]) -> list[Any]:
    return list(await asyncio.wait_for(asyncio.gather(*aws), timeout=30))

"""kopf handler registration: the only module that talks to kopf's decorators.

Handlers only observe and delegate: watch events go to the :class:`Controller`
(work queue), which runs the level-based reconcile. No handler needs a finalizer:
everything the operator creates lives in the cluster and carries an owner
reference to its pool, so Kubernetes' garbage collector removes it; no daemon or
timer is used, so kopf adds no finalizer of its own either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from flexkv_operator import crds, names
from flexkv_operator.active_replica import LeaderElection
from flexkv_operator.context import OperatorContext, OperatorSettings
from flexkv_operator.controller import Controller
from flexkv_operator.kube import USER_AGENT, Connection, KubeClient
from flexkv_operator.metrics import Readiness, serve

logger = logging.getLogger(__name__)

AGENT_LABELS = {names.LABEL_NAME: names.AGENT_APP}
MANAGED_LABELS = {names.LABEL_MANAGED_BY: names.MANAGER}


async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Tune kopf once and start the controller loop."""
    settings.posting.level = logging.WARNING
    # CRDs come with the chart before the operator starts and namespaces are named
    # exactly, so kopf need not scan (and poll) for new CRDs or namespaces.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    connection: Connection = memo["connection"]
    operator_settings: OperatorSettings = memo["settings"]
    # The identity in the User-Agent tells replicas apart in audit logs.
    client = KubeClient(connection, user_agent=f"{USER_AGENT}/{operator_settings.identity}")
    await client.open()
    ctx = OperatorContext.create(client, operator_settings)
    controller = Controller(ctx)
    memo["client"] = client
    memo["controller"] = controller
    if operator_settings.leader_election:
        namespaces = list(memo.get("namespaces") or [])
        election = LeaderElection(
            client=client,
            namespace=operator_settings.election_namespace or (namespaces or ["default"])[0],
            name=operator_settings.election_lease,
            identity=operator_settings.identity,
            clock=ctx.clock,
            lease_duration=operator_settings.election_lease_duration,
            renew_deadline=operator_settings.election_renew_deadline,
            retry_period=operator_settings.election_retry_period,
            on_change=controller.leadership_changed,
        )
        controller.active = lambda: election.active
        memo["election"] = election
        memo["election_task"] = asyncio.create_task(election.run(), name="flexkv-election")
    memo["controller_task"] = asyncio.create_task(controller.run(), name="flexkv-controller")
    ctx.metrics.active.set_function(lambda: 1.0 if controller.active() else 0.0)

    def running() -> bool:
        task: asyncio.Task[None] | None = memo.get("controller_task")
        return task is not None and not task.done()

    readiness = Readiness(
        clock=ctx.clock, controller_running=running, tracked_leases=lambda: len(ctx.tracker)
    )
    memo["readiness"] = readiness
    if operator_settings.metrics_port:
        memo["metrics_runner"] = await serve(
            ctx.metrics, readiness, "0.0.0.0", operator_settings.metrics_port
        )
    logger.info(
        "Operator started",
        extra={
            "identity": operator_settings.identity,
            "leader_election": operator_settings.leader_election,
        },
    )


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    for name in ("election_task", "controller_task"):
        task: asyncio.Task[None] | None = memo.get(name)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=10)
    election: LeaderElection | None = memo.get("election")
    if election is not None:
        await asyncio.wait_for(election.release(), timeout=10)
    runner = memo.get("metrics_runner")
    if runner is not None:
        await runner.cleanup()
    client: KubeClient | None = memo.get("client")
    if client is not None:
        await client.close()


def pool_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    memo["controller"].observe_pool(event.get("type"), dict(event["object"]))


def lease_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    readiness: Readiness | None = memo.get("readiness")
    if readiness is not None:
        readiness.lease_event()
    memo["controller"].observe_lease(event.get("type"), dict(event["object"]))


def daemon_set_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    memo["controller"].observe_owned(dict(event["object"]))


def liveness(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    task: asyncio.Task[None] | None = memo.get("controller_task")
    if task is None or task.done():
        raise kopf.PermanentError("The controller loop is not running")
    controller: Controller = memo["controller"]
    return {"pools": len(controller.pools), "leases": len(controller.ctx.tracker)}


def register(registry: kopf.OperatorRegistry) -> kopf.OperatorRegistry:
    """Register every handler into ``registry`` (one registry per operator instance)."""
    kopf.on.startup(registry=registry)(startup)
    kopf.on.cleanup(registry=registry)(cleanup)
    kopf.on.probe(id="controller", registry=registry)(liveness)
    kopf.on.event(crds.GROUP, crds.VERSION, crds.POOL_PLURAL, registry=registry)(pool_event)
    kopf.on.event("coordination.k8s.io", "v1", "leases", labels=AGENT_LABELS, registry=registry)(
        lease_event
    )
    kopf.on.event("apps", "v1", "daemonsets", labels=MANAGED_LABELS, registry=registry)(
        daemon_set_event
    )
    return registry

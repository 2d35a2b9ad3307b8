"""The agent's heartbeat: its own ``coordination.k8s.io/v1`` Lease (docs/contracts.md
section 2), created on start and renewed every ``retryPeriodSeconds``.

Every renewal is a merge patch carrying the last seen ``metadata.resourceVersion``
as a precondition; a 409 means someone else wrote the Lease, so the heartbeat
re-reads it and renews on the fresh version. A 404 (Lease deleted) recreates it.
The Kubernetes client is synchronous, so calls run in a worker thread, each bounded
by ``renewDeadlineSeconds``. On stop the Lease is renewed one last time with
``flexkv.io/ready: "false"`` and then left to expire.

When the agent knows its pod (``podName`` and ``podUid``, from the downward API)
the Lease carries an owner reference to that pod, set on every write: Kubernetes'
garbage collector deletes the Lease once the pod is gone, so a deleted pool
(whose DaemonSet and pods go with it) leaves no Lease behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client import CoordinationV1Api
from kubernetes.client.exceptions import ApiException

from node_agent.config import AgentConfig
from node_agent.contract import kube
from node_agent.contract.kube import lease_name
from node_agent.vocab.recent_errors import RecentErrors

log = logging.getLogger(__name__)

HeartbeatInfo = Callable[[], dict[str, Any]]
"""Returns the current ``memberships`` (list), ``tiers`` (dict), ``ready`` (bool) and
``cacheEpoch`` (int) of the agent; called once per renewal."""


def _rv_of(lease: Any) -> str | None:
    meta = getattr(lease, "metadata", None)
    return getattr(meta, "resource_version", None)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseHeartbeat:
    """Keeps the agent's Lease fresh. ``healthy`` is False once a renewal has not
    succeeded for ``renewDeadlineSeconds``."""

    name = "heartbeat"

    def __init__(self, api: CoordinationV1Api, cfg: AgentConfig, info: HeartbeatInfo,
                 errors: RecentErrors | None = None,
                 endpoints: dict[str, str] | None = None) -> None:
        self._api = api
        self._cfg = cfg
        self._info = info
        self._errors = errors
        self.lease_name = lease_name(cfg.node_name)
        self._endpoints = endpoints or {
            "http": f"{cfg.advertise_address}:{cfg.ports.http}",
            "fanout": f"tcp://{cfg.advertise_address}:{cfg.ports.fanout}",
        }
        self._rv: str | None = None
        self._renew_lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.last_renewed: float | None = None  # time.monotonic()
        self.renewals = 0
        self.conflicts = 0

    # -- state ---------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """True while the renewal loop runs."""
        return self._task is not None and not self._task.done()

    @property
    def healthy(self) -> bool:
        """True when the last successful renewal is within ``renewDeadlineSeconds``."""
        return (self.last_renewed is not None and time.monotonic() - self.last_renewed
                <= self._cfg.heartbeat.renew_deadline_seconds)

    # -- the Lease -----------------------------------------------------------

    def owner_references(self) -> list[dict[str, Any]]:
        """The agent pod as the Lease's owner (not its controller), when known."""
        cfg = self._cfg
        if not (cfg.pod_name and cfg.pod_uid):
            return []
        return [{"apiVersion": "v1", "kind": "Pod", "name": cfg.pod_name, "uid": cfg.pod_uid}]

    def _body(self, ready_override: bool | None = None) -> dict[str, Any]:
        info = self._info()
        ready = info.get("ready", False) if ready_override is None else ready_override
        cfg = self._cfg
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.lease_name,
                "namespace": cfg.namespace,
                "labels": {kube.LABEL_NAME: kube.AGENT_APP,
                           kube.LABEL_POOL: cfg.pool, kube.LABEL_NODE: cfg.node_name},
                "annotations": {
                    kube.ANNOTATION_ENDPOINTS: json.dumps(self._endpoints, sort_keys=True),
                    kube.ANNOTATION_MEMBERSHIPS: json.dumps(info.get("memberships", [])),
                    kube.ANNOTATION_TIERS: json.dumps(info.get("tiers", {}), sort_keys=True),
                    kube.ANNOTATION_READY: "true" if ready else "false",
                    kube.ANNOTATION_CACHE_EPOCH: str(info.get("cacheEpoch", cfg.cache_epoch)),
                    # None (nothing to report) deletes the annotation in a patch.
                    kube.ANNOTATION_LOOKUPS: (json.dumps(info["lookups"], sort_keys=True)
                                              if info.get("lookups") is not None else None),
                },
            },
            "spec": {
                "holderIdentity": cfg.holder_identity,
                "leaseDurationSeconds": round(cfg.heartbeat.lease_duration_seconds),
                "renewTime": _now(),
            },
        }
        owners = self.owner_references()
        if owners:
            body["metadata"]["ownerReferences"] = owners
        return body

    def _timeout(self) -> float:
        return self._cfg.heartbeat.renew_deadline_seconds

    def _create(self) -> None:
        body = self._body()
        annotations = body["metadata"]["annotations"]
        body["metadata"]["annotations"] = {k: v for k, v in annotations.items()
                                           if v is not None}
        body["spec"]["acquireTime"] = body["spec"]["renewTime"]
        lease = self._api.create_namespaced_lease(
            self._cfg.namespace, body, _request_timeout=self._timeout())  # type: ignore[arg-type]
        self._rv = _rv_of(lease)

    def _read(self) -> bool:
        """Refresh the known resourceVersion; False when the Lease does not exist."""
        try:
            lease = self._api.read_namespaced_lease(
                self.lease_name, self._cfg.namespace, _request_timeout=self._timeout())
        except ApiException as exc:
            if exc.status == 404:
                self._rv = None
                return False
            raise
        self._rv = _rv_of(lease)
        return True

    def renew_once(self, ready_override: bool | None = None) -> None:
        """One renewal (blocking): create, patch, or re-read and patch after a conflict.
        Renewals are serialised: one abandoned by a timeout may still be running."""
        with self._renew_lock:
            self._renew(ready_override)

    def _renew(self, ready_override: bool | None) -> None:
        for _ in range(3):
            if self._rv is None and not self._read():
                try:
                    self._create()
                    break
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                    continue  # created meanwhile by an earlier incarnation: read it
            body = self._body(ready_override)
            body["metadata"]["resourceVersion"] = self._rv
            try:
                lease = self._api.patch_namespaced_lease(
                    self.lease_name, self._cfg.namespace, body, _request_timeout=self._timeout())
            except ApiException as exc:
                if exc.status == 409:
                    self.conflicts += 1
                    self._rv = None  # re-read and decide again
                    continue
                if exc.status == 404:
                    self._rv = None
                    continue
                raise
            self._rv = _rv_of(lease)
            break
        else:
            raise RuntimeError(
                f"Lease {self._cfg.namespace}/{self.lease_name} kept conflicting; another "
                "writer updates it: check that one agent runs per node"
            )
        self.last_renewed = time.monotonic()
        self.renewals += 1

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Create or adopt the Lease, then renew in the background. A failure of the
        first renewal is logged and retried by the loop (the API may come later)."""
        try:
            await asyncio.to_thread(self.renew_once)
        except Exception as exc:
            self._report(exc)
        self._task = asyncio.create_task(self._loop(), name="lease-heartbeat")

    def _report(self, exc: BaseException) -> None:
        msg = f"Lease {self._cfg.namespace}/{self.lease_name} renewal failed: {exc}"
        log.warning("Lease renewal failed", extra={"lease": self.lease_name, "error": str(exc)})
        if self._errors is not None:
            self._errors.record(self.name, msg)

    async def _loop(self) -> None:
        period = self._cfg.heartbeat.retry_period_seconds
        while not self._stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), period)
            if self._stopping.is_set():
                return
            try:
                await asyncio.wait_for(asyncio.to_thread(self.renew_once), self._timeout() * 2)
            except Exception as exc:
                self._report(exc)

    async def stop(self) -> None:
        """Stop renewing; publish ``ready: false`` once (bounded) and let the Lease expire."""
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, self._timeout())
        try:
            await asyncio.wait_for(asyncio.to_thread(self.renew_once, False), self._timeout())
        except Exception as exc:
            self._report(exc)

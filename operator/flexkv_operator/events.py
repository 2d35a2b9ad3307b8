"""Kubernetes Events about pools and groups (core/v1), posted best-effort.

:class:`EventRecorder` aggregates like client-go's recorder: an Event with the
same involved object, type, reason and message as one already posted is not
posted again; the existing Event's ``count`` goes up by one and its
``lastTimestamp`` moves. A retried failure therefore shows as one Event with a
count, not one Event per retry.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flexkv_operator.kube import ApiError, KubeClient, NotFound, api_path

logger = logging.getLogger(__name__)

NORMAL = "Normal"
WARNING = "Warning"
MAX_REMEMBERED = 4096


def _stamp(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def event_body(
    involved: dict[str, Any],
    event_type: str,
    reason: str,
    message: str,
    reporter: str,
    now: datetime.datetime,
) -> dict[str, Any]:
    """A new core/v1 Event about ``involved`` with ``count`` 1."""
    meta = involved.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    stamp = _stamp(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta.get('name', 'object')}.{uuid.uuid4().hex[:12]}",
            "namespace": namespace,
        },
        "involvedObject": {
            "apiVersion": involved.get("apiVersion"),
            "kind": involved.get("kind"),
            "name": meta.get("name"),
            "namespace": namespace,
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": event_type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "flexkv-operator"},
        "reportingComponent": "flexkv.io/operator",
        "reportingInstance": reporter,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


@dataclass
class _Posted:
    namespace: str
    name: str
    count: int


@dataclass
class EventRecorder:
    """Posts Events, aggregating repeats of the same one (module docstring)."""

    client: KubeClient
    reporter: str
    wall_clock: Callable[[], datetime.datetime] = field(
        default=lambda: datetime.datetime.now(datetime.UTC)
    )
    _posted: OrderedDict[tuple[str, ...], _Posted] = field(default_factory=OrderedDict)

    async def post(
        self, involved: dict[str, Any], event_type: str, reason: str, message: str
    ) -> None:
        """Post (or count again) one Event; failures are logged only, because an Event
        is never worth failing a reconcile for."""
        meta = involved.get("metadata") or {}
        namespace = str(meta.get("namespace") or "default")
        key = (
            namespace,
            str(involved.get("kind")),
            str(meta.get("name")),
            str(meta.get("uid")),
            event_type,
            reason,
            message[:1024],
        )
        now = self.wall_clock()
        try:
            previous = self._posted.get(key)
            if previous is not None:
                try:
                    await self.client.patch(
                        api_path("v1", "events", previous.namespace, previous.name),
                        {"count": previous.count + 1, "lastTimestamp": _stamp(now)},
                    )
                    previous.count += 1
                    self._posted.move_to_end(key)
                    return
                except NotFound:
                    del self._posted[key]  # expired (Events have a TTL): post a new one
            body = event_body(involved, event_type, reason, message, self.reporter, now)
            await self.client.create(api_path("v1", "events", namespace), body)
            self._posted[key] = _Posted(namespace, body["metadata"]["name"], 1)
            while len(self._posted) > MAX_REMEMBERED:
                self._posted.popitem(last=False)
        except ApiError as exc:
            logger.warning(
                "Could not post event",
                extra={"reason": reason, "object": meta.get("name"), "error": str(exc)},
            )


async def post_event(
    client: KubeClient,
    involved: dict[str, Any],
    event_type: str,
    reason: str,
    message: str,
    reporter: str,
) -> None:
    """Post one Event without aggregation (see :class:`EventRecorder` for that)."""
    await EventRecorder(client, reporter).post(involved, event_type, reason, message)

"""Kubernetes Events about pools and groups (core/v1), posted best-effort."""

from __future__ import annotations

import datetime
import logging
import uuid
from typing import Any

from flexkv_operator.kube import ApiError, KubeClient, api_path

logger = logging.getLogger(__name__)

NORMAL = "Normal"
WARNING = "Warning"


async def post_event(
    client: KubeClient,
    involved: dict[str, Any],
    event_type: str,
    reason: str,
    message: str,
    reporter: str,
) -> None:
    """Post one Event about ``involved`` (a full object body); failures are logged only,
    because an Event is never worth failing a reconcile for."""
    meta = involved.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
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
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await client.create(api_path("v1", "events", namespace), body)
    except ApiError as exc:
        logger.warning(
            "Could not post event",
            extra={"reason": reason, "object": meta.get("name"), "error": str(exc)},
        )

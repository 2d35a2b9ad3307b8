"""Running the operator: connection discovery and kopf's main loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Any

import kopf

from flexkv_operator import handlers
from flexkv_operator.context import OperatorSettings
from flexkv_operator.kube import Connection

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def discover_connection() -> tuple[Connection, kopf.ConnectionInfo]:
    """In-cluster service account first, then kubeconfig, as kopf does."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
        settings=settings
    )
    if info is None:
        raise kopf.LoginError(
            "No Kubernetes credentials: run in a pod with a service account or set KUBECONFIG"
        )
    token_file = SERVICE_ACCOUNT_TOKEN if SERVICE_ACCOUNT_TOKEN.exists() else None
    static_token = info.token

    def token() -> str | None:
        # Projected service-account tokens rotate; re-read the file on every request.
        return token_file.read_text().strip() if token_file is not None else static_token

    ca_data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
    connection = Connection(
        server=info.server,
        token_provider=token,
        ca_path=str(info.ca_path) if info.ca_path else None,
        ca_data=ca_data,
        insecure=bool(info.insecure),
        certificate_path=str(info.certificate_path) if info.certificate_path else None,
        private_key_path=str(info.private_key_path) if info.private_key_path else None,
    )
    return connection, info


async def run_operator(
    *,
    connection: Connection,
    login: kopf.ConnectionInfo,
    settings: OperatorSettings,
    namespaces: Collection[str] = (),
    clusterwide: bool = False,
    liveness_endpoint: str | None = None,
    stop_flag: asyncio.Event | threading.Event | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
) -> None:
    """Run one operator instance until ``stop_flag`` is set (or forever).

    Every instance gets its own kopf registry and memo, so several can run in one
    process (tests run two to race them). kopf peering is not used: with
    ``settings.leader_election`` only the replica holding the operator Lease acts
    (leadership.py); without it every instance acts, and the conditional writes
    keep their leader decisions consistent."""
    registry = handlers.register(kopf.OperatorRegistry())

    def login_fn(**_: Any) -> kopf.ConnectionInfo:
        return login

    kopf.on.login(registry=registry)(login_fn)
    memo = kopf.Memo(connection=connection, settings=settings, namespaces=list(namespaces))
    await kopf.operator(
        registry=registry,
        memo=memo,
        namespaces=list(namespaces),
        clusterwide=clusterwide,
        standalone=True,
        liveness_endpoint=liveness_endpoint,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )

"""A small async Kubernetes API client (aiohttp) with bounded retries.

The operator's own reads and writes go through here: children, Leases,
KVCacheGroups, status and Events. It speaks JSON and merge patches only (no PUT),
so it works against any conforming server and the emulated one in tests.
Transient answers (429, 5xx, connection errors, timeouts) are retried with
capped exponential backoff; 404 and 409 surface as :class:`NotFound` and
:class:`Conflict` for the caller to decide (a 409 on a conditional write means:
re-read and decide again).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
USER_AGENT = "flexkv-operator"  # names the operator's own requests in audit logs
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """A non-retryable (or retried-out) answer from the API server."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        self.status = status
        self.method = method
        self.path = path
        self.message = message
        super().__init__(f"{method} {path} answered {status}: {message}")


class NotFound(ApiError):
    """404: the object or resource does not exist."""


class Conflict(ApiError):
    """409: already exists (create) or a resourceVersion precondition failed (patch)."""


@dataclass(frozen=True)
class Connection:
    """Where and how to reach the API server."""

    server: str
    token_provider: Callable[[], str | None] = lambda: None
    ca_path: str | None = None
    ca_data: str | None = None
    insecure: bool = False
    certificate_path: str | None = None
    private_key_path: str | None = None


def api_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """REST path of a collection or object: ``/api/v1/...`` or ``/apis/<group>/<v>/...``."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


class KubeClient:
    """JSON over HTTP to one API server; open with ``async with`` or :meth:`open`."""

    def __init__(
        self,
        connection: Connection,
        *,
        request_timeout: float = 10.0,
        retries: int = 5,
        backoff: float = 0.1,
        max_backoff: float = 2.0,
        user_agent: str = USER_AGENT,
        on_error: Callable[[str, int], None] | None = None,
    ) -> None:
        self._conn = connection
        self._user_agent = user_agent
        # Told (method, status) of every request that ends in an error other than 404
        # and 409 (which callers expect); status 0 means no answer.
        self.on_error = on_error
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._retries = retries
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl_context(), limit=64)
            self._session = aiohttp.ClientSession(
                base_url=self._conn.server, connector=connector, timeout=self._timeout
            )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> KubeClient:
        await self.open()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    def _ssl_context(self) -> ssl.SSLContext | bool:
        if not self._conn.server.startswith("https"):
            return False
        if self._conn.insecure:
            return False
        context = ssl.create_default_context(cafile=self._conn.ca_path, cadata=self._conn.ca_data)
        if self._conn.certificate_path:
            context.load_cert_chain(self._conn.certificate_path, self._conn.private_key_path)
        return context

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """Send one request, retrying transient failures; return the JSON answer."""
        if self._session is None:
            raise RuntimeError("KubeClient is not open; use 'async with KubeClient(...)'")
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        token = self._conn.token_provider()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if body is not None:
            headers["Content-Type"] = content_type
        delay = self._backoff
        for attempt in range(self._retries + 1):
            try:
                async with self._session.request(
                    method, path, json=body, params=params, headers=headers
                ) as response:
                    status = response.status
                    try:
                        payload = await response.json(content_type=None)
                    except ValueError:
                        payload = {"message": (await response.text())[:500]}
            except (TimeoutError, aiohttp.ClientError) as exc:
                status, payload = 0, {"message": f"{type(exc).__name__}: {exc}"}
            if 200 <= status < 300:
                return payload if isinstance(payload, dict) else {"items": payload}
            message = str(payload.get("message", "")) if isinstance(payload, dict) else ""
            if (status in RETRIED_STATUSES or status == 0) and attempt < self._retries:
                logger.debug(
                    "Retrying API request",
                    extra={"method": method, "path": path, "status": status, "attempt": attempt},
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_backoff)
                continue
            if status == 404:
                raise NotFound(status, method, path, message)
            if status == 409:
                raise Conflict(status, method, path, message)
            if self.on_error is not None:
                self.on_error(method, status)
            raise ApiError(status, method, path, message)
        raise AssertionError("unreachable")  # pragma: no cover

    async def get(self, path: str) -> dict[str, Any]:
        return await self.request("GET", path)

    async def get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except NotFound:
            return None

    async def list(self, path: str, label_selector: dict[str, str] | None = None) -> list[Any]:
        """List a collection; label equality is also checked here, client-side."""
        params = None
        if label_selector:
            params = {"labelSelector": ",".join(f"{k}={v}" for k, v in label_selector.items())}
        items = (await self.request("GET", path, params=params)).get("items") or []
        if label_selector:
            items = [
                item
                for item in items
                if all(
                    ((item.get("metadata") or {}).get("labels") or {}).get(k) == v
                    for k, v in label_selector.items()
                )
            ]
        return list(items)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body=body)

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch; put ``metadata.resourceVersion`` in ``body`` to make it conditional."""
        return await self.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    async def delete(self, path: str, resource_version: str | None = None) -> dict[str, Any] | None:
        """Delete; None when already gone. With ``resource_version`` the delete is
        conditional (409 :class:`Conflict` when the object changed since)."""
        body = None
        if resource_version:
            body = {
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "preconditions": {"resourceVersion": resource_version},
            }
        try:
            return await self.request("DELETE", path, body=body)
        except NotFound:
            return None

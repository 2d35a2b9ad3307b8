"""The FastAPI app: ``create_app`` builds it around an :class:`AgentProbe`, the
metrics registry and the background services its lifespan owns.

Endpoints (docs/agent.md shows example outputs):

* ``GET /healthz`` - 200 ``{"alive": true, "components": {...}}`` while every
  component's loop runs, else 503 naming the dead ones (liveness: restart me).
* ``GET /readyz`` - 200 when every readiness component is ready, else 503; the body
  is the per-component breakdown. Also sets ``flexkv_agent_ready``.
* ``GET /status`` - the agent's status document.
* ``GET /metrics`` - Prometheus text exposition of the injected registry.
* ``POST /v1/lookup`` - cached tokens of a prompt by tier (node_agent/http/lookup.py),
  when the app is given a ``lookup``.

The lifespan starts the services in order and stops them in reverse order on
shutdown (SIGTERM via uvicorn), so an engine socket stops before the connector.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from node_agent.http.lookup import (
    MAX_BODY_BYTES,
    LookupRequest,
    LookupRequestError,
    body_too_large,
    parse_lookup,
    parse_lookup_binary,
)
from node_agent.http.state import AgentProbe, Service
from node_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)


def create_app(probe: AgentProbe, metrics: AgentMetrics,
               services: Sequence[Service] = (),
               lookup: Callable[[LookupRequest], dict[str, Any]] | None = None) -> FastAPI:
    """Build the agent's HTTP app; ``services`` run for the app's lifetime; ``lookup``
    answers ``POST /v1/lookup`` (raising :class:`LookupRequestError`)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        started: list[Service] = []
        try:
            for svc in services:
                await svc.start()
                started.append(svc)
                log.info("Service started", extra={"service": svc.name})
            yield
        finally:
            for svc in reversed(started):
                try:
                    await svc.stop()
                    log.info("Service stopped", extra={"service": svc.name})
                except Exception:
                    log.exception("Service did not stop cleanly", extra={"service": svc.name})

    app = FastAPI(title="flexkv-agent", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        comps = probe.liveness()
        alive = all(comps.values())
        return JSONResponse({"alive": alive, "components": comps},
                            status_code=200 if alive else 503)

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        comps = probe.readiness()
        ready = all(bool(c.get("ready")) for c in comps.values())
        metrics.ready.set(1 if ready else 0)
        return JSONResponse({"ready": ready, "components": comps},
                            status_code=200 if ready else 503)

    @app.get("/status")
    def status() -> JSONResponse:
        return JSONResponse(probe.status())

    @app.get("/metrics")
    def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if lookup is not None:
        answer = lookup

        @app.post("/v1/lookup")
        async def v1_lookup(request: Request) -> JSONResponse:
            # Answered on the event loop: hashing and matching a 32K-token prompt take
            # well under a millisecond and nothing here waits.
            try:
                body = await _bounded_body(request)
                if request.headers.get("content-type") == "application/octet-stream":
                    req = parse_lookup_binary(body, request.query_params)
                else:
                    req = parse_lookup(body)
                return JSONResponse(answer(req))
            except LookupRequestError as exc:
                return JSONResponse({"error": exc.message}, status_code=exc.status)

    return app


async def _bounded_body(request: Request) -> bytes:
    """The request's body, refused (:func:`body_too_large`) as soon as its declared
    length or the bytes received pass :data:`MAX_BODY_BYTES`: a huge body is never
    buffered."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise body_too_large(int(declared))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise body_too_large(None)
    return bytes(body)

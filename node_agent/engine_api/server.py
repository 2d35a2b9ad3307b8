"""The engine API server: a pyzmq ROUTER on the agent's ``ipc://`` engine socket.

Every request is decoded and schema-checked (:mod:`.protocol`) on the event loop,
then handed to the service callable in a bounded thread pool, because connector
calls block (transfers, fan-out waits). The connector's own waits end every call
inside ``engineCallSeconds`` (:mod:`.budget`); ``call_timeout`` is a last resort
behind them (``engineCallSeconds`` plus a margin): when it runs out the engine
gets a ``TimeoutError`` reply and the overrun is logged as an internal error,
because the worker thread cannot be stopped and may still touch the slots. A
malformed message of any kind gets an error reply (with the request id when it
could be read) and the server keeps serving.

What is bounded: calls in flight (``max_inflight``, default 4 x the worker
threads; a message beyond it is answered ``NotReady: agent busy`` at once,
without decoding it); the thread pool (``max_workers``); each frame
(``MAXMSGSIZE``: libzmq drops the peer's connection instead of buffering a
larger one); messages queued in libzmq (``RCVHWM``); and what this process keeps
of one message (``MAX_FRAMES`` + 1 frames and ``MAX_MESSAGE_BYTES`` plus one
frame; the rest is read and dropped, then the message is refused). Not bounded
here: libzmq delivers a multipart message whole, so it buffers every frame of
one message (each at most ``MAXMSGSIZE``) before this process sees any; only
the socket's file mode (engines of the agent's UID/GID) limits who can send.

Shutdown (:meth:`EngineServer.stop`) stops taking requests, lets in-flight calls
finish within a grace period, answers the rest with an error, and closes the
socket and removes its path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import zmq
import zmq.asyncio

from node_agent.engine_api import protocol
from node_agent.engine_api.buffers import HandleError
from node_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

Service = Callable[[protocol.Request], Any]
_RCVHWM = 256
"""Messages libzmq queues for the server (beyond it, senders block or drop)."""


class NotReadyError(RuntimeError):
    """The agent cannot serve this call yet (e.g. the rank has not registered)."""


class _Overran(Exception):
    """A call outlived the server's last-resort bound (its thread still runs)."""

    def __init__(self, op: str, timeout: float) -> None:
        super().__init__(
            f"{op} did not finish within {timeout:g}s (engineCallSeconds plus margin); the "
            "agent may still be using the call's slots: treat them as busy until "
            "poll_completed reports the rid or the agent restarts, and report this agent bug"
        )


class ErrorSink(Protocol):
    """Where the server reports request failures (the agent's recent-error log)."""

    def record(self, component: str, message: str) -> None:
        """Remember one error for /status."""


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, protocol.ProtocolError):
        return "ProtocolError"
    if isinstance(exc, ValueError | HandleError):
        return "ValueError"
    if isinstance(exc, TimeoutError):
        return "TimeoutError"
    if isinstance(exc, NotReadyError):
        return "NotReady"
    if isinstance(exc, KeyError):
        return "KeyError"
    return "InternalError"


class EngineServer:
    """Serves engine requests on ``endpoint`` (``ipc://<path>``) with ``service``."""

    name = "engine_api"

    def __init__(
        self,
        endpoint: str,
        service: Service,
        metrics: AgentMetrics,
        call_timeout: float,
        errors: ErrorSink | None = None,
        max_workers: int = 8,
        max_inflight: int | None = None,
    ) -> None:
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"engine endpoint {endpoint!r} must be ipc://<path>")
        self.endpoint = endpoint
        self.path = Path(endpoint[len("ipc://"):])
        self._service = service
        self._metrics = metrics
        self._timeout = call_timeout
        self._errors = errors
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="engine-call")
        self.max_inflight = max_inflight if max_inflight is not None else 4 * max_workers
        self.refused_busy = 0
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._closing = False
        self.served = 0

    @property
    def alive(self) -> bool:
        """True while the receive loop runs."""
        return self._recv_task is not None and not self._recv_task.done()

    @property
    def inflight(self) -> int:
        """Requests being served now."""
        return len(self._inflight)

    async def start(self) -> None:
        """Bind the socket (creating its directory) and start the receive loop."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)  # per frame, in libzmq
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.bind(self.endpoint)
        with contextlib.suppress(OSError):
            os.chmod(self.path, 0o660)
        self._sock = sock
        self._recv_task = asyncio.create_task(self._recv_loop(), name="engine-api-recv")
        log.info("Engine API listening", extra={"endpoint": self.endpoint})

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while not self._closing:
            try:
                msg = await self._recv_bounded(self._sock)
            except (zmq.ZMQError, asyncio.CancelledError):
                if self._closing:
                    return
                raise
            if len(msg) < 2:
                continue  # ROUTER always prepends the identity; nothing to answer to
            ident, frames = msg[0], msg[1:]
            if len(self._inflight) >= self.max_inflight:
                await self._refuse_busy(ident, frames)
                continue
            task = asyncio.create_task(self._serve(ident, frames))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    @staticmethod
    async def _recv_bounded(sock: zmq.asyncio.Socket) -> list[bytes]:
        """One message, keeping at most one frame past ``MAX_FRAMES`` and one frame
        past ``MAX_MESSAGE_BYTES`` (enough for the decoder to name the excess);
        further frames are read and dropped, never kept."""
        kept = [await sock.recv(copy=True)]
        total = 0
        while sock.getsockopt(zmq.RCVMORE):
            frame = await sock.recv(copy=True)
            # kept[0] is the peer identity; the decoder limits the rest.
            if len(kept) <= protocol.MAX_FRAMES + 1 and total <= protocol.MAX_MESSAGE_BYTES:
                kept.append(frame)
                total += len(frame)
        return kept

    async def _refuse_busy(self, ident: bytes, frames: list[bytes]) -> None:
        self.refused_busy += 1
        self._metrics.engine_requests.labels(op="busy", outcome="error").inc()
        reply = protocol.encode_error(
            protocol.peek_id(frames), "NotReady",
            f"agent busy: {len(self._inflight)} engine calls in flight (limit "
            f"{self.max_inflight}); retry after a short back-off")
        assert self._sock is not None
        try:
            await self._sock.send_multipart([ident, *reply], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("Busy reply not sent", extra={"error": str(exc)})

    async def _serve(self, ident: bytes, frames: list[bytes]) -> None:
        start = time.perf_counter()
        op = "invalid"
        req_id: int | None = None
        try:
            req = protocol.decode_request(frames)
            op, req_id = req.op, req.id
            loop = asyncio.get_running_loop()
            work = loop.run_in_executor(self._pool, self._service, req)
            done, _ = await asyncio.wait({work}, timeout=self._timeout)
            if not done:
                raise _Overran(op, self._timeout)
            result = work.result()
            reply = protocol.encode_reply(req_id, result)
            outcome = "ok"
        except asyncio.CancelledError:
            # Shutdown cut this call short: still tell the engine, then stop.
            if self._sock is not None and not self._sock.closed:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart(
                        [ident, *protocol.encode_error(
                            req_id, "NotReady", "agent is shutting down; retry after restart"
                        )],
                        flags=zmq.NOBLOCK,
                    )
            raise
        except _Overran as exc:
            # The connector's own waits should have ended the call first: its worker
            # thread still runs, so this answer cannot promise the slots are idle.
            reply = protocol.encode_error(req_id, "TimeoutError", str(exc))
            outcome = "timeout"
            self._record(op, "InternalError", str(exc))
            log.error("Engine call overran the server's last-resort bound", extra={
                "op": op, "request_id": req_id, "timeout_seconds": self._timeout})
        except TimeoutError as exc:
            msg = str(exc) or f"{op} timed out"
            reply = protocol.encode_error(req_id, "TimeoutError", msg)
            outcome = "timeout"
            self._record(op, "TimeoutError", msg)
        except Exception as exc:
            if req_id is None:
                req_id = protocol.peek_id(frames)
            etype = _error_type(exc)
            reply = protocol.encode_error(req_id, etype, str(exc) or repr(exc))
            outcome = "error"
            self._record(op, etype, str(exc))
            if etype == "InternalError":
                log.exception("Engine call failed", extra={"op": op, "request_id": req_id})
        self._metrics.engine_requests.labels(op=op, outcome=outcome).inc()
        self._metrics.engine_request_seconds.labels(op=op).observe(time.perf_counter() - start)
        self.served += 1
        if self._sock is not None and not self._sock.closed:
            try:
                await self._sock.send_multipart([ident, *reply])
            except zmq.ZMQError as exc:
                log.warning("Engine reply not sent", extra={"op": op, "error": str(exc)})

    def _record(self, op: str, etype: str, message: str) -> None:
        if self._errors is not None:
            self._errors.record("engine_api", f"{op}: {etype}: {message}")

    async def stop(self, grace: float | None = None) -> None:
        """Stop receiving, let in-flight calls finish within ``grace`` seconds (default
        the call timeout), answer the rest "shutting down", close."""
        grace = self._timeout if grace is None else grace
        self._closing = True
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await self._recv_task
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("Engine calls cut short by shutdown", extra={"count": len(pending)})
                # Let them send their "shutting down" replies.
                await asyncio.wait(pending, timeout=1.0)
        if self._sock is not None:
            self._sock.close(linger=200)  # bounded flush of the last replies
        self._ctx.term()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        log.info("Engine API closed", extra={"endpoint": self.endpoint})

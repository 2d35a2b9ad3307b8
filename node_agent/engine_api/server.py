"""The engine API server: a pyzmq ROUTER on the agent's ``ipc://`` engine socket.

One I/O thread owns the socket: it receives, decodes and schema-checks every
request (:mod:`.protocol`), answers the ``inline_ops`` (``ping``: no stage, no
blocking) and the calls ``inline`` picks (a single-stage group's ``lookup``,
``store_kv`` and ``release``: short locks only) itself, and hands every other call to a bounded
thread pool, because connector calls block (transfers, fan-out waits). A
worker queues its reply and wakes the I/O thread through a pipe; the I/O
thread sends it. Calls that only wait for an event (``park``: a single-stage
group's ``wait_completed``) are kept by the I/O thread without a worker and
answered when :meth:`EngineServer.wake` (or their time bound) makes it poll
them. Keeping the socket off the asyncio loop (shared with HTTP and
the heartbeat) and off worker threads makes a ping cost about one pyzmq round
trip plus decoding. The connector's own
waits end every call inside ``engineCallSeconds`` (:mod:`.budget`);
``call_timeout`` is a last resort behind them (``engineCallSeconds`` plus a
margin): when it runs out the engine gets a ``TimeoutError`` reply and the
overrun is logged as an internal error, because the worker thread cannot be
stopped and may still touch the slots. A ``retrieve`` whose worker still runs
then (or at shutdown) is answered ``SlotsInUse`` instead (a timeout is a miss to
the engine, which would recompute into the slots that worker may still write),
and a call answered before a worker took it is never run. A malformed message of any kind gets an
error reply (with the request id when it could be read) and the server keeps
serving.

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
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import zmq

from node_agent.engine_api import protocol
from node_agent.engine_api.buffers import HandleError
from node_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

Service = Callable[[protocol.Request], Any]
# Plain ints: pyzmq's IntFlag constants cost an enum operation per use on the hot path.
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)
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


def _still_writing(op: str, why: str) -> str:
    """The ``SlotsInUse`` message of a slot-writing call answered while it runs."""
    return (f"{op} {why} and its worker still runs: it may still write the call's slots; "
            "keep them out of use (never recompute into them nor reuse them) until the "
            "agent restarts, and report this agent bug")


class ErrorSink(Protocol):
    """Where the server reports request failures (the agent's recent-error log)."""

    def record(self, component: str, message: str) -> None:
        """Remember one error for /status."""


def _error_type(exc: BaseException) -> str:
    wire = getattr(exc, "wire_type", None)  # an error that names its own reply type
    if isinstance(wire, str) and wire in protocol.ERROR_TYPES:
        return wire
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


class Parked:
    """How the I/O thread answers a call that waits for an event without a
    worker (``wait_completed``): ``poll()`` returns the result once there is
    one (None while there is none; it must not block, and what it returns is
    sent at once), ``seconds`` bounds the wait, after which the answer is
    ``expired``."""

    __slots__ = ("expired", "poll", "seconds")

    def __init__(self, poll: Callable[[], Any], seconds: float, expired: Any) -> None:
        self.poll = poll
        self.seconds = seconds
        self.expired = expired


class _Waiting:
    """A parked call: who asked, what, since when, until when, and how to answer."""

    __slots__ = ("deadline", "ident", "parked", "req", "start")

    def __init__(self, ident: bytes, req: protocol.Request, start: float, deadline: float,
                 parked: Parked) -> None:
        self.ident = ident
        self.req = req
        self.start = start
        self.deadline = deadline
        self.parked = parked


_WRITES_SLOTS: frozenset[str] = frozenset({"retrieve"})
"""Ops whose worker writes the engine's slots: answered ``SlotsInUse``, never a
timeout (which engines read as a miss), when the server answers while it runs."""


class _Call:
    """One request being served: who asked, what, and when it must be answered.

    ``started`` (a worker runs the service) and ``answered`` (the I/O thread
    answered without the worker's result: last resort or shutdown) change only
    under the server's claim lock, so exactly one of them wins: a call answered
    before a worker took it is never run, and one answered while it runs is
    known to be running (:meth:`EngineServer._settle`)."""

    __slots__ = ("answered", "deadline", "ident", "op", "req_id", "start", "started")

    def __init__(self, ident: bytes, op: str, req_id: int | None, start: float,
                 deadline: float) -> None:
        self.ident = ident
        self.op = op
        self.req_id = req_id
        self.start = start
        self.deadline = deadline
        self.started = False
        self.answered = False


class EngineServer:
    """Serves engine requests on ``endpoint`` (``ipc://<path>``) with ``service``.

    ``inline_ops`` names operations that never block (``ping``): the I/O thread
    answers them itself, without the hop to a worker thread. ``inline(req)``,
    when given, picks further requests to answer there (the service knows
    which calls of which stage wait only for short locks); it must be cheap
    and must not raise; those calls are answered in arrival order and never
    refused as busy (``max_inflight`` bounds calls that take a worker).
    ``park(req)``, when given, returns a :class:`Parked`
    for requests that wait for an event (None for any other): the I/O thread
    keeps them without a worker and polls them whenever it is woken
    (:meth:`wake`, by whatever makes them answerable) or their time is up; it
    must be cheap and must not raise."""

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
        inline_ops: frozenset[str] = frozenset(),
        inline: Callable[[protocol.Request], bool] | None = None,
        park: Callable[[protocol.Request], Parked | None] | None = None,
    ) -> None:
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"engine endpoint {endpoint!r} must be ipc://<path>")
        self.endpoint = endpoint
        self.path = Path(endpoint[len("ipc://"):])
        self._service = service
        self._metrics = metrics
        self._timeout = call_timeout
        self._errors = errors
        self._inline_ops = inline_ops
        self._inline = inline
        self._park = park
        self._waiting: list[_Waiting] = []
        """Parked calls (at most ``max_inflight``), answered by the I/O thread."""
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="engine-call")
        self.max_inflight = max_inflight if max_inflight is not None else 4 * max_workers
        self.refused_busy = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._calls: dict[int, _Call] = {}
        """Calls handed to a worker and not answered yet, by a server-local key."""
        self._claim = threading.Lock()
        """Guards every ``_Call.started`` / ``_Call.answered`` change."""
        self._keys = itertools.count()
        self._done: deque[tuple[int, list[bytes], str]] = deque()
        """(call key, reply frames, outcome) from workers, sent by the I/O thread."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pipe_lock = threading.Lock()
        self._pipe_open = True
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._accepting = True
        self._cut = False
        self._closing = False
        self.served = 0

    @property
    def alive(self) -> bool:
        """True while the I/O thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def parked(self) -> int:
        """Calls parked on the I/O thread (see ``park``), not answered yet."""
        return len(self._waiting)

    @property
    def inflight(self) -> int:
        """Requests handed to a worker and not answered yet."""
        return len(self._calls)

    async def start(self) -> None:
        """Bind the socket (creating its directory) and start the I/O thread."""
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
        self._thread = threading.Thread(target=self._io_loop, name="engine-api-io", daemon=True)
        self._thread.start()
        log.info("Engine API listening", extra={"endpoint": self.endpoint})

    # -- the I/O thread (the only one that touches the socket) -------------------

    def _io_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        listening = True
        try:
            while True:
                if listening and not self._accepting:
                    poller.unregister(sock)
                    listening = False
                if self._cut:
                    self._answer_cut_short()
                    return
                if self._closing and self._waiting:
                    self._answer_waiting(expire_all=True)
                if self._closing and not self._calls and not self._done:
                    return
                wait_ms = self._next_wait_ms()
                events = dict(poller.poll(wait_ms))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                self._send_done()
                if listening and sock in events:
                    self._drain_requests(sock)
                if self._waiting:
                    self._answer_waiting()
                self._expire_overruns()
        except zmq.ZMQError as exc:
            if not self._closing:
                log.error("Engine API I/O thread stopped", extra={"error": str(exc)})

    def _next_wait_ms(self) -> int:
        if not self._calls and not self._waiting:
            return 100
        first = min([c.deadline for c in self._calls.values()]
                    + [w.deadline for w in self._waiting])
        return max(0, min(100, math.ceil((first - time.monotonic()) * 1000)))

    def _drain_requests(self, sock: zmq.Socket[bytes]) -> None:
        """Serve one message: the poll that woke the loop found it queued.

        One per wake-up, not a drained burst: checking for a next message
        (``EVENTS``) holds the GIL while libzmq processes its command queue,
        about as long as the poll that does the same check with the GIL
        released, and a rank's engine sends one call at a time."""
        try:
            msg = self._recv_bounded(sock)
        except zmq.Again:
            return  # a spurious wake-up
        if len(msg) < 2:
            return  # ROUTER always prepends the identity; nothing to answer to
        self._accept(msg[0], msg[1:])

    @staticmethod
    def _recv_bounded(sock: zmq.Socket[bytes]) -> list[bytes]:
        """One message (``zmq.Again`` when none is queued), keeping at most one frame
        past ``MAX_FRAMES`` and one frame past ``MAX_MESSAGE_BYTES`` (enough for the
        decoder to name the excess); further frames are read and dropped, never kept.
        libzmq delivers a message whole, so the frames after the first are there."""
        kept = [sock.recv(_NOBLOCK)]
        total = 0
        while sock.getsockopt(_RCVMORE):
            frame = sock.recv()
            # kept[0] is the peer identity; the decoder limits the rest.
            if len(kept) <= protocol.MAX_FRAMES + 1 and total <= protocol.MAX_MESSAGE_BYTES:
                kept.append(frame)
                total += len(frame)
        return kept

    def _accept(self, ident: bytes, frames: list[bytes]) -> None:
        start = time.perf_counter()
        try:
            req = protocol.decode_request(frames)
        except Exception as exc:
            self._finish(ident, "invalid", protocol.peek_id(frames), start,
                         *self._error_reply("invalid", protocol.peek_id(frames), exc))
            return
        if req.op in self._inline_ops or (self._inline is not None and self._inline(req)):
            # Never refused as busy: answered here, it holds no worker and no slot.
            # An engine may send an inline call without waiting for its answer
            # (EngineClient.end_claim_nowait), which must not be lost.
            try:
                reply, outcome = protocol.encode_reply(req.id, self._service(req)), "ok"
            except Exception as exc:
                reply, outcome = self._error_reply(req.op, req.id, exc)
            self._finish(ident, req.op, req.id, start, reply, outcome)
            return
        if len(self._calls) >= self.max_inflight:
            self._refuse_busy(ident, frames)
            return
        parked = self._park(req) if self._park is not None and \
            len(self._waiting) < self.max_inflight else None
        if parked is not None:
            self._waiting.append(_Waiting(ident, req, start,
                                          time.monotonic() + parked.seconds, parked))
            self._answer_waiting()
            return
        key = next(self._keys)
        call = _Call(ident, req.op, req.id, start, time.monotonic() + self._timeout)
        self._calls[key] = call
        self._pool.submit(self._work, key, call, req)

    def _work(self, key: int, call: _Call, req: protocol.Request) -> None:
        """Worker thread: run the service, queue the reply, wake the I/O thread.
        A call the server answered before this worker took it (its last resort ran
        out while it was queued) is never run: its engine was told it failed and may
        have reused the call's slots."""
        with self._claim:
            if call.answered:
                log.warning("Engine call answered before a worker took it; not run",
                            extra={"op": req.op, "request_id": req.id})
                return
            call.started = True
        try:
            reply, outcome = protocol.encode_reply(req.id, self._service(req)), "ok"
        except Exception as exc:
            reply, outcome = self._error_reply(req.op, req.id, exc)
        self._done.append((key, reply, outcome))
        self._wake()

    def _answer_waiting(self, expire_all: bool = False) -> None:
        """Answer every parked call that has its result, or whose time is up
        (all of them with ``expire_all``: shutdown). Polled and sent on this
        thread, so a result taken by ``poll()`` is always sent."""
        now = time.monotonic()
        keep: list[_Waiting] = []
        for w in self._waiting:
            try:
                result = w.parked.poll()
            except Exception as exc:
                self._finish(w.ident, w.req.op, w.req.id, w.start,
                             *self._error_reply(w.req.op, w.req.id, exc))
                continue
            if result is None and not expire_all and now < w.deadline:
                keep.append(w)
                continue
            answer = w.parked.expired if result is None else result
            self._finish(w.ident, w.req.op, w.req.id, w.start,
                         protocol.encode_reply(w.req.id, answer), "ok")
        self._waiting = keep

    def wake(self) -> None:
        """Make the I/O thread look at its parked calls now (any thread; cheap)."""
        self._wake()

    def _send_done(self) -> None:
        while self._done:
            key, reply, outcome = self._done.popleft()
            call = self._calls.pop(key, None)
            if call is None:
                continue  # answered already (overran or cut short by shutdown)
            self._finish(call.ident, call.op, call.req_id, call.start, reply, outcome)

    def _expire_overruns(self) -> None:
        if not self._calls:
            return
        now = time.monotonic()
        for key in [k for k, c in self._calls.items() if c.deadline <= now]:
            call = self._calls.pop(key)
            # The connector's own waits should have ended the call first: its worker
            # thread still runs, so this answer cannot promise the slots are idle.
            running = self._settle(call)
            msg = str(_Overran(call.op, self._timeout))
            self._record(call.op, "InternalError", msg)
            log.error("Engine call overran the server's last-resort bound", extra={
                "op": call.op, "request_id": call.req_id, "timeout_seconds": self._timeout,
                "running": running})
            if running and call.op in _WRITES_SLOTS:
                # A timeout is a miss to the engine, which then recomputes into (or
                # frees) the slots this worker may still write.
                reply = protocol.encode_error(call.req_id, "SlotsInUse", _still_writing(
                    call.op, f"did not finish within {self._timeout:g}s (engineCallSeconds "
                             "plus margin)"))
            else:
                reply = protocol.encode_error(call.req_id, "TimeoutError", msg)
            self._finish(call.ident, call.op, call.req_id, call.start, reply, "timeout")

    def _settle(self, call: _Call) -> bool:
        """Mark ``call`` answered by the server itself; True when a worker already
        runs it (it may still touch the slots), False when none will."""
        with self._claim:
            call.answered = True
            return call.started

    def _answer_cut_short(self) -> None:
        """Shutdown cut the remaining calls short: still tell their engines."""
        self._send_done()
        self._answer_waiting(expire_all=True)
        calls, self._calls = list(self._calls.values()), {}
        if calls:
            log.warning("Engine calls cut short by shutdown", extra={"count": len(calls)})
        for call in calls:
            if self._settle(call) and call.op in _WRITES_SLOTS:
                self._send(call.ident, protocol.encode_error(call.req_id, "SlotsInUse",
                           _still_writing(call.op, "was cut short by the agent's shutdown")))
                continue
            self._send(call.ident, protocol.encode_error(
                call.req_id, "NotReady", "agent is shutting down; retry after restart"))

    def _error_reply(self, op: str, req_id: int | None, exc: Exception,
                     ) -> tuple[list[bytes], str]:
        if isinstance(exc, TimeoutError):
            msg = str(exc) or f"{op} timed out"
            self._record(op, "TimeoutError", msg)
            return protocol.encode_error(req_id, "TimeoutError", msg), "timeout"
        etype = _error_type(exc)
        self._record(op, etype, str(exc))
        if etype == "InternalError":
            log.error("Engine call failed", exc_info=exc,
                      extra={"op": op, "request_id": req_id})
        return protocol.encode_error(req_id, etype, str(exc) or repr(exc)), "error"

    def _finish(self, ident: bytes, op: str, req_id: int | None, start: float,
                reply: list[bytes], outcome: str) -> None:
        count, seconds = self._children.get((op, outcome)) or self._child_metrics(op, outcome)
        count.inc()
        seconds.observe(time.perf_counter() - start)
        self.served += 1
        self._send(ident, reply)

    def _child_metrics(self, op: str, outcome: str) -> tuple[Any, Any]:
        """The labelled counter and histogram of ``(op, outcome)``, looked up once
        (ops come from the schema, outcomes from a fixed set: the cache stays small)."""
        pair = (self._metrics.engine_requests.labels(op=op, outcome=outcome),
                self._metrics.engine_request_seconds.labels(op=op))
        self._children[(op, outcome)] = pair
        return pair

    def _send(self, ident: bytes, reply: list[bytes]) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, *reply], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("Engine reply not sent", extra={"error": str(exc)})

    def _refuse_busy(self, ident: bytes, frames: list[bytes]) -> None:
        self.refused_busy += 1
        self._metrics.engine_requests.labels(op="busy", outcome="error").inc()
        self._send(ident, protocol.encode_error(
            protocol.peek_id(frames), "NotReady",
            f"agent busy: {len(self._calls)} engine calls in flight (limit "
            f"{self.max_inflight}); retry after a short back-off"))

    def _record(self, op: str, etype: str, message: str) -> None:
        if self._errors is not None:
            self._errors.record("engine_api", f"{op}: {etype}: {message}")

    def _wake(self) -> None:
        """Wake the I/O thread (a byte on the pipe; a full pipe is awake already).
        Under the pipe lock: :meth:`stop` closes the pipe only under it, so a
        worker that outlives the server never writes to a reused descriptor."""
        with self._pipe_lock:
            if self._pipe_open:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_w, b"\x00")

    async def stop(self, grace: float | None = None) -> None:
        """Stop receiving, let in-flight calls finish within ``grace`` seconds (default
        the call timeout), answer the rest "shutting down", close."""
        grace = self._timeout if grace is None else grace
        self._accepting = False
        self._closing = True
        self._wake()
        deadline = time.monotonic() + grace
        while self.alive and (self._calls or self._done) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._cut = True
        self._wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        if self._sock is not None:
            self._sock.close(linger=200)  # bounded flush of the last replies
        self._ctx.term()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._pipe_lock:
            self._pipe_open = False
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        log.info("Engine API closed", extra={"endpoint": self.endpoint})

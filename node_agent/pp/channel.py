"""Fan-out transport: one bound receiving server per agent, one sender per peer.

Every connection is one-way, which keeps each ZeroMQ socket owned by one
thread (or a lock) and every send a direct call without a thread hop:

* :class:`FanoutServer` binds the agent's fan-out endpoint with a PULL socket
  (a Curve server when keys are given), decodes each message on its own thread
  and hands it to the handler registered for the message's group. A batch
  frame (:func:`~node_agent.pp.messages.pack_batch`) is split and each of its
  messages handled in order as if sent alone. Malformed messages and messages
  for unknown groups are dropped and reported through ``on_drop``.
* :class:`Sender` is a PUSH socket connected to one peer's server (a Curve
  client). ``send`` never blocks: a full queue (SNDHWM) returns False and the
  caller treats the peer as out of sync. LINGER is 0 so closing never waits.

ZeroMQ reconnects a sender on its own after either side restarts; messages
queued or in flight across such a restart may be lost, which the stream layer
(seq numbers, heartbeats, HELLO/SYNC) detects.

:class:`FaultPlan` is a test hook on a sender (off by default): it drops,
duplicates or reorders the next messages so tests can prove the stream layer
never applies out of order.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

import zmq

from node_agent.pp.auth import CurveKeys, PoolAuthenticator, make_client, make_server
from node_agent.pp.messages import (
    MalformedMessage,
    Message,
    decode,
    decode_many,
    is_batch,
    unpack,
    unpack_batch,
)

log = logging.getLogger(__name__)

DEFAULT_HWM = 10_000
Handler = Callable[[Message], None]
DropHook = Callable[[str, str], None]
"""``on_drop(group, reason)``; group is ``"?"`` when it could not be decoded."""


def _shared_context() -> zmq.Context[zmq.Socket[bytes]]:
    return zmq.Context.instance()


class FanoutServer:
    """Receives fan-out messages on ``endpoint`` and dispatches them by group.

    ``endpoint`` may use port 0 (``tcp://127.0.0.1:0``); :attr:`endpoint` then
    holds the bound address after :meth:`start`. Handlers run on the server
    thread, one message at a time, in arrival order.
    """

    def __init__(
        self,
        endpoint: str,
        keys: CurveKeys | None,
        on_drop: DropHook | None = None,
        hwm: int = DEFAULT_HWM,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        # A private context by default: a ZAP handler is per context, and each
        # server installs its own.
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.Context()
        self._keys = keys
        self._bind = endpoint
        self._hwm = hwm
        self._on_drop = on_drop
        self._handlers: dict[str, Handler] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fanout-server", daemon=True)
        self._auth = PoolAuthenticator(self._ctx, keys) if keys is not None else None
        self.endpoint = endpoint
        self.received = 0

    def register(self, group: str, handler: Handler) -> None:
        """Route messages of ``group`` to ``handler`` (replaces a previous one)."""
        with self._lock:
            self._handlers[group] = handler

    def unregister(self, group: str) -> None:
        """Stop routing ``group``; its messages are then dropped as ``unknown_group``."""
        with self._lock:
            self._handlers.pop(group, None)

    def start(self, timeout: float = 5.0) -> FanoutServer:
        """Bind and start receiving; raises the bind error, or ``TimeoutError``."""
        if self._auth is not None:
            self._auth.start()
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"Fan-out server did not bind {self._bind} within {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread and close the socket (bounded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx and not self._thread.is_alive():
            self._ctx.term()

    def _drop(self, group: str, reason: str) -> None:
        if self._on_drop is not None:
            self._on_drop(group, reason)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PULL)
        try:
            sock.linger = 0
            sock.rcvhwm = self._hwm
            if self._keys is not None:
                make_server(sock, self._keys)
            sock.bind(self._bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = RuntimeError(
                f"Cannot bind fan-out endpoint {self._bind}: {exc}; "
                "check ports.fanout is free and the address is local"
            )
            sock.close(0)
            self._ready.set()
            return
        self._ready.set()
        try:
            # One blocking receive per message (bounded, so close() is noticed): a
            # poll, then non-blocking receives until one raised Again, cost a
            # poller, extra ZeroMQ calls and an exception per wake-up, which made
            # a paced decision's one-way latency measurably longer (docs/pp.md).
            sock.rcvtimeo = 50
            while not self._stop.is_set():
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    continue
                self.received += 1
                if len(frames) == 1 and is_batch(frames[0]):
                    self._dispatch_batch(frames[0])
                else:
                    self._dispatch(frames)
        finally:
            sock.close(0)

    def _dispatch_batch(self, data: bytes) -> None:
        """Each message of a batch frame, in order, exactly as if sent alone."""
        try:
            messages = unpack_batch(data)
        except MalformedMessage as exc:
            log.warning("Dropped a malformed fan-out batch", extra={"error": str(exc)})
            self._drop("?", "malformed")
            return
        for frame, msg in zip(messages, decode_many(messages), strict=True):
            if isinstance(msg, MalformedMessage):
                self._malformed([frame], msg)
            else:
                self._deliver(msg)

    def _dispatch(self, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
        except MalformedMessage as exc:
            self._malformed(frames, exc)
            return
        self._deliver(msg)

    def _malformed(self, frames: list[bytes], exc: MalformedMessage) -> None:
        group = "?"
        try:
            if len(frames) == 1:
                group = unpack(frames[0])[1].decode(errors="replace")[:64] or "?"
        except MalformedMessage:
            pass
        log.warning("Dropped a malformed fan-out message",
                    extra={"group": group, "error": str(exc)})
        self._drop(group, "malformed")

    def _deliver(self, msg: Message) -> None:
        with self._lock:
            handler = self._handlers.get(msg.env.group)
        if handler is None:
            self._drop(msg.env.group, "unknown_group")
            return
        try:
            handler(msg)
        except Exception:
            log.exception("Fan-out handler failed", extra={"group": msg.env.group,
                                                           "op": msg.env.op.name})


class FaultPlan:
    """Test hook: mangles the next messages a :class:`Sender` sends.

    Queue actions with :meth:`drop`, :meth:`duplicate`, :meth:`reorder`; each
    applies to one upcoming message in order. Never set in production.
    """

    def __init__(self) -> None:
        self._actions: collections.deque[str] = collections.deque()
        self._held: list[list[bytes]] | None = None
        self.applied: collections.Counter[str] = collections.Counter()
        self.log: list[tuple[str, list[bytes]]] = []
        """What each action applied to (the frames), in order: tests assert on what
        the fault hit (a stream message or a heartbeat), never on timing."""

    def drop(self, count: int = 1) -> None:
        """Drop the next ``count`` messages."""
        self._actions.extend(["drop"] * count)

    def duplicate(self, count: int = 1) -> None:
        """Send each of the next ``count`` messages twice."""
        self._actions.extend(["dup"] * count)

    def reorder(self) -> None:
        """Hold the next message and send it after the one that follows it."""
        self._actions.append("hold")

    def mangle(self, frames: list[bytes]) -> list[list[bytes]]:
        """The frames to really send for one message."""
        out: list[list[bytes]] = []
        action = self._actions.popleft() if self._actions else None
        if action is not None:
            self.applied[action] += 1
            self.log.append((action, frames))
        if action == "drop":
            pass
        elif action == "dup":
            out = [frames, frames]
        elif action == "hold":
            self._held = [frames]
        else:
            out = [frames]
        if action != "hold" and self._held is not None and out:
            out = out + self._held
            self._held = None
        return out


class Sender:
    """Thread-safe, non-blocking, one-way connection to one peer's server."""

    def __init__(
        self,
        endpoint: str,
        keys: CurveKeys | None,
        hwm: int = DEFAULT_HWM,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._ctx = ctx or _shared_context()
        self._lock = threading.Lock()
        sock = self._ctx.socket(zmq.PUSH)
        sock.linger = 0
        sock.sndhwm = hwm
        sock.reconnect_ivl = 50
        sock.reconnect_ivl_max = 1000
        if keys is not None:
            make_client(sock, keys)
        sock.connect(endpoint)
        self._sock: zmq.Socket[bytes] | None = sock
        self.faults: FaultPlan | None = None
        self.sent = 0
        self.full = 0

    def send(self, frames: list[bytes]) -> bool:
        """Queue one message; False when the queue is full or the sender closed."""
        with self._lock:
            if self._sock is None:
                return False
            batches = [frames] if self.faults is None else self.faults.mangle(frames)
            for f in batches:
                try:
                    if len(f) == 1:
                        self._sock.send(f[0], flags=zmq.NOBLOCK, copy=len(f[0]) < 65536)
                    else:
                        self._sock.send_multipart(f, flags=zmq.NOBLOCK)
                except zmq.Again:
                    self.full += 1
                    return False
                self.sent += 1
            return True

    def close(self) -> None:
        """Close now (LINGER 0: queued messages are discarded)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None

"""The library an engine rank imports to use its node's agent.

:class:`EngineClient` has the connector's signatures and contract
(``lookup`` / ``retrieve`` / ``store_kv`` / ``release`` / ``poll_completed``) and
forwards them over the agent's ``ipc://`` engine socket. Every call is bounded by
``timeout`` seconds in all, including the transparent re-registration and retry
after an agent restart (one deadline per call). Errors:

* :class:`AgentUnavailableError` when no agent listens on the socket (the message
  names the path and how to start one), also during a call: a killed agent
  leaves its socket file behind, and a call waiting for an answer checks every
  :data:`LISTENER_CHECK_SECONDS` that something still listens on it (the agent
  process is gone: it no longer reads any of the call's slots);
* :class:`AgentTimeoutError` when the agent did not answer in time. The agent
  ends every call inside its ``engineCallSeconds``, so an agent ``TimeoutError``
  answer means the call is over; after a client-side timeout (no answer) treat
  the call's slots as possibly in use for ``engineCallSeconds`` plus the margin
  of docs/agent.md from when the call was sent (a ``store_kv``'s source slots
  until ``poll_completed`` reports the rid);
* ``ValueError`` for a rejected argument, carrying the agent's message (for
  example ``store_kv: token_ids has 3 entries but kv_indices has 2 entries``);
* :class:`EngineAPIError` for anything else the agent reports.

A client is thread-safe (one call in flight at a time). Its ``timeout`` must
exceed the agent's ``engineCallSeconds`` plus margin (11 s by default) so that the
agent's own timeout answer arrives first; the default is 15 s, and
:meth:`EngineClient.register_kv_buffers` logs a warning when the agent's
``register`` reply names a bound (``callSeconds``) the timeout is not above.
After an engine restart, create a client and call
:meth:`EngineClient.register_kv_buffers` again: the agent swaps in the new
buffers and keeps its cached blocks.

:class:`SharedKVBuffers` allocates KV buffers in POSIX shared memory so that CPU
engines (tests, the demo) can share them with the agent.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy.typing as npt
import torch
import zmq

from node_agent.engine_api import protocol
from node_agent.engine_api.buffers import CREATED_HERE, cuda_handle, dtype_name
from node_agent.engine_api.protocol import array_length, bool_array, layout_to_wire
from node_agent.vocab.layout import KVLayout, LayoutName
from node_agent.vocab.tokens import int64_array

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
SOCKET_CHECK_SECONDS = 0.1
"""A connected client checks that the agent's socket file exists at most this often."""
#: Claim ids a client keeps for ``commit_load`` (the oldest are forgotten first).
MAX_REMEMBERED_CLAIMS = 4096
LISTENER_CHECK_SECONDS = 0.25
"""While a call waits for its answer, it checks this often that something still
listens on the socket: a killed agent leaves its socket file behind, and a call to
it would otherwise wait out its whole timeout."""


def listener_gone(path: str) -> bool:
    """True when nothing listens on the Unix socket ``path`` (connection refused, or
    no file): the agent process is gone. A connection attempt that does not fail so
    is closed at once, before any byte is sent."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:  # e.g. a full backlog: a listener exists
        return False
    finally:
        probe.close()
    return False


class EngineAPIError(RuntimeError):
    """The agent answered with an error that is not a bad argument."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type


class SlotsInUseError(EngineAPIError):
    """A ``retrieve`` whose load copy did not stop after its timeout and abort (a
    hung device): the agent may still write the call's slots at any later time.
    Not a miss: keep those slots out of use (fail or hold the request, never
    recompute into them nor give them to another request) until the agent
    restarts. Not a sign that the agent is down (:func:`agent_down` is False)."""

    def __init__(self, message: str) -> None:
        super().__init__("SlotsInUse", message)


class AgentUnavailableError(ConnectionError):
    """No agent is listening on the engine socket."""


class AgentTimeoutError(TimeoutError):
    """The agent did not answer within the client's timeout."""


#: Errors of a call that may mean "the agent cannot serve right now" (gone, restarting,
#: overloaded); :func:`agent_down` tells them from an answer about one call.
AGENT_ERRORS = (AgentUnavailableError, AgentTimeoutError, EngineAPIError, ConnectionError,
                OSError)


def agent_down(exc: BaseException) -> bool:
    """True when ``exc`` says the agent is gone, restarting or overloaded: no agent
    listens, no answer in time, a connection error, or the agent answered
    ``NotReady`` or ``InternalError``. False for an answer about this one call (a
    rejected argument, any other error type)."""
    if isinstance(exc, EngineAPIError):
        return exc.error_type in ("NotReady", "InternalError")
    return isinstance(exc, AGENT_ERRORS)


class AgentHealth:
    """Whether an engine integration calls its agent now: the one client-side
    resilience policy (the vLLM connector and the SGLang plugin both use it).

    * A call that failed because the agent is down (:func:`agent_down`, or a
      caller's ``down=True``) marks it down; any other failure is an answer about
      that one call and changes nothing (it is logged as a refusal).
    * While down, no call is made except a probe every ``retry_seconds``: with
      ``probe``, a thread of its own calls it (nothing in the engine waits on it);
      without, :meth:`should_call` grants the caller's next call as the probe once
      ``retry_seconds`` passed since the failure (then again ``retry_seconds``
      later). The first call or probe that succeeds marks the agent up again.
    * Each outage is logged once when it starts and once when it ends (warnings
      on ``log``); ``on_failure`` runs for every failure that means down (a
      counter), ``on_change(up)`` on every change of state (a gauge).

    ``name``, ``fallback`` and ``resumed`` word the log lines: "<name> unavailable,
    <fallback> ...", "<name> reachable again, <resumed>". Thread-safe.
    """

    def __init__(self, retry_seconds: float, *, probe: Callable[[], object] | None = None,
                 on_failure: Callable[[], None] | None = None,
                 on_change: Callable[[bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 log: logging.Logger | None = None, name: str = "FlexKV agent",
                 fallback: str = "serving without the cache (recompute)",
                 resumed: str = "cache hits resume") -> None:
        if retry_seconds <= 0:
            raise ValueError(f"retry_seconds={retry_seconds} must be > 0 seconds")
        self.retry_seconds = retry_seconds
        self._probe, self._on_failure, self._on_change = probe, on_failure, on_change
        self._clock = clock
        self._log = log or logging.getLogger(__name__)
        self._name, self._fallback, self._resumed = name, fallback, resumed
        self._lock = threading.Lock()
        self._down = False
        self._next_probe = 0.0
        self._probing = False
        self._closed = threading.Event()

    @property
    def down(self) -> bool:
        """True from a failure that means down until a call or probe succeeds."""
        return self._down

    def should_call(self) -> bool:
        """Whether to make a call now: True while up; while down, False with a
        probe thread, else True once per ``retry_seconds`` (that call is the probe)."""
        with self._lock:
            if not self._down:
                return True
            if self._probe is not None:
                return False
            now = self._clock()
            if now < self._next_probe:
                return False
            self._next_probe = now + self.retry_seconds
            return True

    def retry_now(self) -> None:
        """Grant the next call as a probe at once (an explicit connect)."""
        with self._lock:
            self._next_probe = 0.0

    def failed(self, what: str, exc: BaseException, down: bool | None = None) -> bool:
        """Record that call ``what`` failed with ``exc``; True when that marks the
        agent down (``down`` overrides :func:`agent_down`'s verdict)."""
        if not (agent_down(exc) if down is None else down):
            self._log.warning("%s refused %s, treating it as a miss: %s", self._name, what, exc,
                              extra={"op": what, "error": str(exc)})
            return False
        if self._on_failure is not None:
            self._on_failure()
        with self._lock:
            first = not self._down
            self._down = True
            self._next_probe = self._clock() + self.retry_seconds
            start = (self._probe is not None and not self._probing
                     and not self._closed.is_set())
            self._probing = self._probing or start
        if first:
            self._log.warning(
                "%s unavailable, %s and calling it again only once it answers a probe "
                "(every %ss): %s failed: %s", self._name, self._fallback, self.retry_seconds,
                what, exc, extra={"op": what, "error": str(exc),
                                  "retrySeconds": self.retry_seconds})
            if self._on_change is not None:
                self._on_change(False)
        if start:
            threading.Thread(target=self._probe_loop, name="flexkv-probe", daemon=True).start()
        return True

    def succeeded(self) -> None:
        """A call or probe was answered: the agent is up (logged when it was down)."""
        if not self._down:
            return
        with self._lock:
            was, self._down = self._down, False
        if was:
            self._log.warning("%s reachable again, %s", self._name, self._resumed)
            if self._on_change is not None:
                self._on_change(True)

    def _probe_loop(self) -> None:
        assert self._probe is not None
        while not self._closed.wait(self.retry_seconds):
            try:
                self._probe()
            except Exception as exc:
                self._log.debug("%s still unavailable: %s", self._name, exc)
                continue
            break
        with self._lock:
            self._probing = False
        if not self._closed.is_set():
            self.succeeded()

    def close(self) -> None:
        """Stop probing (a probe thread ends within one ``retry_seconds``)."""
        self._closed.set()


@dataclass(frozen=True)
class RankInfo:
    """Who the calling engine rank is: its PP group (``replica``) and position."""

    replica: str
    pp_rank: int = 0
    pp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    model: str = ""
    """The digest of the engine's model identity
    (:meth:`node_agent.engine_api.identity.ModelIdentity.digest`); the agent keys the
    stage's blocks by it and refuses calls of another model. ``""``: none sent."""

    def to_wire(self) -> dict[str, Any]:
        """The rank as the engine API sends it."""
        wire: dict[str, Any] = {"replica": self.replica, "ppRank": self.pp_rank,
                                "ppSize": self.pp_size, "tpRank": self.tp_rank,
                                "tpSize": self.tp_size}
        if self.model:
            wire["model"] = self.model
        return wire




class EngineClient:
    """One engine rank's connection to its node agent."""

    def __init__(self, socket_path: str | os.PathLike[str], rank: RankInfo,
                 timeout: float = 15.0) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout {timeout} must be > 0 seconds")
        # Accept the agent's engineSocket as written in agent.yaml or as the
        # ipc:// endpoint the agent logs and reports in /status.
        path = os.fspath(socket_path)
        self.socket_path = Path(path.removeprefix("ipc://"))
        self.rank = rank
        self._rank_wire = rank.to_wire()  # RankInfo is frozen: build the wire form once
        self.timeout = timeout
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._registration: dict[str, Any] | None = None
        self._in_order: frozenset[str] = frozenset()
        """Ops the agent answers in arrival order on its engine socket's I/O thread
        (the ``inOrder`` of the last ``register`` reply): only these are ever sent
        without waiting (:meth:`release_nowait`)."""
        self._claim_ids: dict[str, int] = {}
        """rid -> the id of the last claim handed to this client (``commit_load``)."""
        self._claims_lock = threading.Lock()
        self._path_str = str(self.socket_path)
        self._file_seen = -math.inf
        """When the socket file was last seen (monotonic); see _check_socket_file."""
        self._rcvtimeo = -1
        """The socket's RCVTIMEO as last set (ms)."""

    # -- transport -----------------------------------------------------------

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"ipc://{self.socket_path}")
            self._sock = sock
        return self._sock

    def _reset_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            self._rcvtimeo = -1

    def _call(self, op: str, args: Mapping[str, Any] | None = None,
              arrays: Mapping[str, Any] | None = None, timeout: float | None = None) -> Any:
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget  # one deadline for the call and its retry
        try:
            return self._call_once(op, args, arrays, deadline, budget)
        except EngineAPIError as exc:
            # A restarted agent has forgotten this rank: register again, retry once.
            if (exc.error_type != "NotReady" or self._registration is None
                    or op == "register" or "has not registered" not in str(exc)):
                raise
            self._registered(self._call_once("register", self._registration, None,
                                             deadline, budget))
            return self._call_once(op, args, arrays, deadline, budget)

    def _lock_within(self, op: str, deadline: float, budget: float) -> None:
        """Take the client's lock, waiting at most until ``deadline``."""
        if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise AgentTimeoutError(
                f"{op}: another call on this client held it for the whole {budget}s; use one "
                "client per thread or raise the client timeout"
            )

    def _check_socket_file(self, now: float) -> None:
        """Raise :class:`AgentUnavailableError` when the agent's socket file is gone.

        A stat per call costs as much as a tenth of a ping, so a connected client
        looks again only once :data:`SOCKET_CHECK_SECONDS` passed since the file
        was last seen; a call sent in between to an agent that just went away
        is delivered to an agent restarted within :data:`LISTENER_CHECK_SECONDS`
        (libzmq reconnects), else ends with :class:`AgentUnavailableError` once
        nothing listens on the socket (:meth:`_check_listener`)."""
        if self._sock is not None and now < self._file_seen + SOCKET_CHECK_SECONDS:
            return
        if not os.path.exists(self._path_str):
            raise AgentUnavailableError(
                f"no flexkv agent at ipc://{self.socket_path}: the socket does not exist. "
                "Start the agent (flexkv-agent run --config agent.yaml) or point the client at "
                "the agent's engineSocket"
            )
        self._file_seen = now

    def _check_listener(self, op: str) -> None:
        """Raise :class:`AgentUnavailableError` when nothing listens on the socket any
        more (the agent was killed; its socket file stays until a new agent binds)."""
        if listener_gone(self._path_str):
            self._reset_socket()
            raise AgentUnavailableError(
                f"{op}: the agent at ipc://{self.socket_path} went away during the call "
                "(nothing listens on its socket); start the agent again"
            )

    def _send(self, frames: list[protocol.Frame]) -> zmq.Socket[bytes]:
        """Queue one request without blocking (the client's lock held); returns the
        socket. :class:`AgentUnavailableError` when the agent takes no messages."""
        sock = self._socket()
        try:
            if len(frames) == 1:
                sock.send(frames[0], _NOBLOCK)
            else:
                sock.send_multipart(frames, flags=_NOBLOCK)
        except zmq.Again:
            self._reset_socket()
            raise AgentUnavailableError(
                f"agent at ipc://{self.socket_path} does not accept messages; "
                "check that the agent process is running"
            ) from None
        return sock

    def _call_once(self, op: str, args: Mapping[str, Any] | None,
                   arrays: Mapping[str, Any] | None, deadline: float, budget: float) -> Any:
        now = time.monotonic()
        self._check_socket_file(now)
        if now >= deadline:
            raise AgentTimeoutError(
                f"{op}: the call's {budget}s were used up before it could be sent (a "
                "re-registration took them); retry the call or raise the client timeout"
            )
        self._lock_within(op, deadline, budget)
        try:
            req_id = next(self._ids)
            sock = self._send(protocol.encode_request(req_id, op, args, arrays))
            while True:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise zmq.Again
                    # A blocking receive bounded by RCVTIMEO (no poller built per
                    # call); the option is set only when the bound changes. Waits
                    # of more than LISTENER_CHECK_SECONDS are cut into slices,
                    # between which a gone agent ends the call (_check_listener).
                    wait_ms = int(min(left, LISTENER_CHECK_SECONDS) * 1000) + 1
                    if wait_ms != self._rcvtimeo:
                        sock.setsockopt(zmq.RCVTIMEO, wait_ms)
                        self._rcvtimeo = wait_ms
                    try:
                        got = [sock.recv()]
                    except zmq.Again:
                        if deadline - time.monotonic() <= 0:
                            raise
                        self._check_listener(op)
                        continue
                    while sock.getsockopt(_RCVMORE):
                        got.append(sock.recv())
                except zmq.Again:
                    # A late reply would be matched to a later call: start afresh.
                    self._reset_socket()
                    raise AgentTimeoutError(
                        f"{op}: no answer from the agent at ipc://{self.socket_path} within "
                        f"{budget}s; check the agent's /healthz or raise the client timeout"
                    ) from None
                reply = protocol.decode_reply(got)
                if reply.id == req_id or reply.id is None:
                    break
        finally:
            self._lock.release()
        if reply.ok:
            return reply.result
        etype, msg = reply.error_type or "InternalError", reply.error_message or ""
        if etype == "ValueError":
            raise ValueError(msg)
        if etype == "TimeoutError":
            raise AgentTimeoutError(msg)
        if etype == "SlotsInUse":
            raise SlotsInUseError(msg)
        raise EngineAPIError(etype, msg)

    # -- the engine API ------------------------------------------------------

    def ping(self, timeout: float | None = None) -> dict[str, Any]:
        """Round trip to the agent; returns its version and ready flag."""
        result: dict[str, Any] = self._call("ping", timeout=timeout)
        return result

    def register_kv_buffers(
        self, layout: KVLayout | Mapping[str, Any],
        buffers: Sequence[Sequence[torch.Tensor | Mapping[str, Any]]],
    ) -> dict[str, Any]:
        """Register this rank's KV buffers, arranged as ``layout`` names them.

        Entries are CUDA tensors (exported as CUDA IPC handles) or ready-made
        handles; CPU buffers must come from :class:`SharedKVBuffers` (pass its
        ``handles``). Re-registering (after an engine restart) replaces the rank's
        buffers; cached blocks stay. The client remembers the registration and
        repeats it once, transparently, if a restarted agent no longer knows it.
        """
        wire_layout = layout_to_wire(layout) if isinstance(layout, KVLayout) else dict(layout)
        handles: list[list[dict[str, Any]]] = []
        for group in buffers:
            row: list[dict[str, Any]] = []
            for b in group:
                if isinstance(b, torch.Tensor):
                    if not b.is_cuda:
                        raise ValueError(
                            "CPU tensors cannot be shared by reference; allocate them with "
                            "SharedKVBuffers and pass its handles"
                        )
                    row.append(cuda_handle(b))
                else:
                    row.append(dict(b))
            handles.append(row)
        args = {"rank": self.rank.to_wire(), "layout": wire_layout, "buffers": handles}
        result: dict[str, Any] = self._call("register", args)
        self._registration = args
        self._registered(result)
        self._check_timeout(result.get("callSeconds"))
        return result

    def _registered(self, reply: Mapping[str, Any]) -> None:
        """Keep what a ``register`` reply says about the agent's ordering."""
        ops = reply.get("inOrder") if isinstance(reply, Mapping) else None
        self._in_order = frozenset(o for o in ops if isinstance(o, str)) \
            if isinstance(ops, list) else frozenset()

    def _check_timeout(self, agent_seconds: object) -> None:
        """Warn when the client timeout is not above the agent's last-resort answer
        time (``callSeconds`` of a ``register`` reply; absent from older agents).

        Below it, the client can give up on a ``retrieve`` whose copy still runs,
        and an engine that then treats the load as a miss recomputes into (or
        reuses) slots that copy may still write."""
        if isinstance(agent_seconds, bool) or not isinstance(agent_seconds, (int, float)):
            return
        if self.timeout <= agent_seconds:
            log.warning(
                "Client timeout is not above the agent's call bound: a load the client gives "
                "up on could still write its slots after the engine reused them; raise the "
                "client timeout (vLLM callTimeoutSeconds, SGLang FLEXKV_AGENT_TIMEOUT) or lower "
                "the agent's timeouts.engineCallSeconds",
                extra={"client_timeout_seconds": self.timeout,
                       "agent_call_seconds": agent_seconds, "socket": str(self.socket_path)})

    def lookup(self, rid: str, token_ids: Sequence[int] | npt.ArrayLike,
               token_mask: npt.ArrayLike | None = None) -> int:
        """Hit tokens: how many leading tokens of ``token_ids`` the cache can load."""
        arrays: dict[str, Any] = {"token_ids": int64_array("lookup: token_ids", token_ids)}
        if token_mask is not None:
            arrays["token_mask"] = bool_array("lookup: token_mask", token_mask)
        return int(self._call("lookup", {"rid": rid, "rank": self._rank_wire}, arrays))

    def retrieve(self, rid: str, slot_mapping: Sequence[int] | npt.ArrayLike) -> int:
        """Load the tokens the last ``lookup`` of ``rid`` hit into ``slot_mapping``;
        returns the number of tokens loaded."""
        return int(self._call("retrieve", {"rid": rid, "rank": self._rank_wire},
                              {"slot_mapping": int64_array("retrieve: slot_mapping",
                                                           slot_mapping)}))

    def lookup_claim(self, rid: str, token_ids: Sequence[int] | npt.ArrayLike,
                     token_mask: npt.ArrayLike | None = None) -> dict[str, Any]:
        """:meth:`lookup` and :meth:`claim_load` in one round trip: ``{"hit",
        "blocks", "tier"}``; ``blocks`` None when the hit cannot be claimed (the
        lookup stays open: call :meth:`retrieve`), ``tier`` then the stage's shared
        tier all the same (None: it has none)."""
        arrays: dict[str, Any] = {"token_ids": int64_array("lookup_claim: token_ids",
                                                           token_ids)}
        if token_mask is not None:
            arrays["token_mask"] = bool_array("lookup_claim: token_mask", token_mask)
        result = dict(self._call("lookup_claim", {"rid": rid, "rank": self._rank_wire},
                                 arrays))
        self._remember_claim(rid, result)
        return result

    def tier(self) -> dict[str, Any] | None:
        """The shared CPU tier the agent hands this stage's loads out of (its handle,
        for :func:`node_agent.backend.cpu_tier.map_tier_fd`), or None when it
        copies every load itself."""
        result = self._call("tier", {"rank": self._rank_wire})
        return None if result is None else dict(result)

    def claim_load(self, rid: str) -> dict[str, Any] | None:
        """Claim the last ``lookup`` of ``rid`` to copy it here, from the agent's
        shared CPU tier: ``{"hit": tokens, "blocks": [tier block per hit block],
        "tier": handle}``, the blocks pinned until :meth:`commit_load`; ``hit`` 0
        for a miss. None when the agent cannot hand this load out: call
        :meth:`retrieve`. :class:`~node_agent.engine_loads.EngineLoads` does the
        whole sequence."""
        result = self._call("claim_load", {"rid": rid, "rank": self._rank_wire})
        if result is None:
            return None
        got = dict(result)
        self._remember_claim(rid, got)
        return got

    def commit_load(self, rid: str, claim: int | None = None) -> bool:
        """End ``rid``'s claimed load: True when its blocks stayed pinned until now
        (the copy read the cached KV), False when the claim had ended first (a miss:
        the copied slots hold undefined data). ``claim``: the ``claim`` id of the
        reply that handed it out; by default the last one this client received for
        ``rid`` (a commit naming an older claim of the rid answers False)."""
        with self._claims_lock:
            remembered = self._claim_ids.pop(rid, -1)
        if claim is None:
            claim = remembered
        return bool(self._call("commit_load", {"rid": rid, "rank": self._rank_wire,
                                               "claim": int(claim)}))

    def end_claim_nowait(self, rid: str, claim: int) -> bool:
        """Send ``commit_load`` of ``rid``'s claim ``claim`` without waiting for the
        answer: for an engine that already knows its copy read only pinned blocks
        (the claim fence did not move: :class:`~node_agent.engine_loads.EngineLoads`),
        so only the unpinning is left to the agent. The answer is dropped when the
        next call reads its own (replies carry their request's id). False when it
        could not be sent (the agent's socket gone, or no room in its queue or
        another call holding this client for the whole client timeout): the
        claim then ends with its lease."""
        with self._claims_lock:
            if self._claim_ids.get(rid) == claim:
                del self._claim_ids[rid]
        try:
            self._send_nowait("commit_load", {"rid": rid, "rank": self._rank_wire,
                                              "claim": int(claim)})
        except (AgentUnavailableError, AgentTimeoutError):
            return False
        return True

    def _send_nowait(self, op: str, args: Mapping[str, Any]) -> None:
        """Queue one request whose answer nobody waits for (the next call drops it).

        Calls sent without waiting can outrun the agent: a full queue then means
        a backlog, not a gone agent, so the send waits (up to the client's
        timeout) for room, dropping the answers that arrive meanwhile.
        :class:`AgentUnavailableError` when nothing listens on the socket any
        more or no room came within the timeout, :class:`AgentTimeoutError`
        when another call held this client too long."""
        self._check_socket_file(time.monotonic())
        deadline = time.monotonic() + self.timeout
        self._lock_within(op, deadline, self.timeout)
        try:
            frames = protocol.encode_request(next(self._ids), op, args, None)
            sock = self._socket()
            while True:
                self._drop_answers()
                try:
                    sock.send_multipart(frames, flags=_NOBLOCK)
                    return
                except zmq.Again:
                    pass
                left = deadline - time.monotonic()
                if left <= 0:
                    self._reset_socket()
                    raise AgentUnavailableError(
                        f"{op}: the agent at ipc://{self.socket_path} took no message for "
                        f"{self.timeout}s; check the agent's /healthz")
                self._check_listener(op)
                sock.poll(int(min(left, LISTENER_CHECK_SECONDS) * 1000) + 1,
                          zmq.POLLIN | zmq.POLLOUT)
        except zmq.ZMQError as exc:
            self._reset_socket()
            raise AgentUnavailableError(
                f"{op}: could not send to the agent at ipc://{self.socket_path} ({exc}); "
                "check that the agent process is running") from None
        finally:
            self._lock.release()

    def _drop_answers(self) -> None:
        """Discard the answers already queued (the client's lock held: no waited
        call is in flight, so each is the answer of a request sent without
        waiting). Keeps them from filling the socket's queue, where the agent
        would drop the answer of a later waited call."""
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                sock.recv(_NOBLOCK)
            except zmq.Again:
                return

    def _remember_claim(self, rid: str, reply: Mapping[str, Any]) -> None:
        """Keep the claim id a reply handed out, for :meth:`commit_load` (bounded)."""
        claim = reply.get("claim")
        if not reply.get("blocks") or not isinstance(claim, int) or claim < 0:
            return
        with self._claims_lock:
            self._claim_ids.pop(rid, None)
            self._claim_ids[rid] = claim
            while len(self._claim_ids) > MAX_REMEMBERED_CLAIMS:
                self._claim_ids.pop(next(iter(self._claim_ids)))

    def store_kv(self, rid: str, token_ids: Sequence[int] | npt.ArrayLike,
                 kv_indices: Sequence[int] | npt.ArrayLike) -> int:
        """Store the KV of ``token_ids`` held in slots ``kv_indices`` (parallel arrays).

        Raises ``ValueError`` naming both counts when the lengths differ; nothing
        is written. Returns the connector's result (task id, or -1 when nothing
        needed writing).
        """
        # The contract's length check first (SGLang's FlexKV connector), on the
        # arrays as given (a 2-D array is never flattened into a matching count;
        # it is refused below).
        n = array_length("store_kv: token_ids", token_ids)
        m = array_length("store_kv: kv_indices", kv_indices)
        if n != m:
            raise ValueError(
                f"store_kv: token_ids has {n} entries but kv_indices has {m} entries"
            )
        ids = int64_array("store_kv: token_ids", token_ids)
        idx = int64_array("store_kv: kv_indices", kv_indices)
        return int(self._call("store_kv", {"rid": rid, "rank": self._rank_wire},
                              {"token_ids": ids, "kv_indices": idx}))

    def poll_completed(self) -> list[str]:
        """Request ids whose stores finished since the last poll (their slots are free)."""
        result = self._call("poll_completed", {"rank": self._rank_wire})
        return [str(r) for r in result]

    def wait_completed(self, timeout: float) -> list[str]:
        """Like :meth:`poll_completed`, but waits up to ``timeout`` seconds for at
        least one rid (``[]`` when none finished in time). The agent watches for
        completions itself, so a finished store is reported within a fraction of
        a millisecond instead of at the engine's next poll."""
        if timeout < 0:
            raise ValueError(f"wait_completed: timeout {timeout} must be >= 0 seconds")
        deadline = time.monotonic() + timeout
        while True:
            left_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            step = min(left_ms, protocol.MAX_WAIT_MS)
            result = self._call("wait_completed", {"rank": self._rank_wire, "timeoutMs": step},
                                timeout=self.timeout + step / 1000)
            if result or step == left_ms:
                return [str(r) for r in result]

    def release(self, rid: str) -> None:
        """Forget ``rid``'s pending lookup (cancels an un-launched load)."""
        self._call("release", {"rid": rid, "rank": self._rank_wire})

    def release_nowait(self, rid: str) -> None:
        """:meth:`release` without waiting for the answer, where the agent answers
        ``release`` in arrival order (its ``register`` reply lists it ``inOrder``:
        a single-stage group on the embedded backend), so the engine's next call is
        handled after it: a release then costs a send, not a round trip, and its
        answer is dropped by that next call. Elsewhere (a PP group, a remote tier,
        FlexKV, before registering, an agent that does not say) this is
        :meth:`release`. Raises what :meth:`release` raises, except errors in
        the dropped answer (the agent has nothing of a rid it does not know)."""
        if "release" not in self._in_order:
            self.release(rid)
            return
        self._send_nowait("release", {"rid": rid, "rank": self._rank_wire})

    def status(self) -> dict[str, Any]:
        """The agent's status (the same document as HTTP ``/status``)."""
        result: dict[str, Any] = self._call("status")
        return result

    def close(self) -> None:
        """Close the socket; the client may not be used afterwards."""
        with self._lock:
            self._reset_socket()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedKVBuffers:
    """KV buffer tensors in POSIX shared memory, with the handles the agent opens.

    ``shapes`` is a list of lists of tensor shapes, arranged as the layout names
    the buffers (``[k_buffers, v_buffers]`` for SGLang MHA); ``tensors`` and
    ``handles`` have the same nesting. The creating process owns the segments:
    :meth:`close` unmaps and unlinks them.
    """

    def __init__(self, shapes: Sequence[Sequence[Sequence[int]]], dtype: torch.dtype,
                 prefix: str = "flexkv") -> None:
        self.tensors: list[list[torch.Tensor]] = []
        self.handles: list[list[dict[str, Any]]] = []
        self._segments: list[shared_memory.SharedMemory] = []
        itemsize = torch.empty(0, dtype=dtype).element_size()
        try:
            for group in shapes:
                trow: list[torch.Tensor] = []
                hrow: list[dict[str, Any]] = []
                for shape in group:
                    nbytes = math.prod(shape) * itemsize
                    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
                    seg = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
                    self._segments.append(seg)
                    CREATED_HERE.add(seg._name)  # type: ignore[attr-defined]
                    t = torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes)
                    t = t.view(dtype).view(tuple(shape))
                    t.zero_()
                    trow.append(t)
                    hrow.append({"kind": "shm", "name": seg.name, "dtype": dtype_name(dtype),
                                 "shape": list(shape), "offset": 0})
                self.tensors.append(trow)
                self.handles.append(hrow)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_layout(cls, layout: KVLayout, num_slots: int) -> SharedKVBuffers:
        """Buffers of one TP rank for ``layout`` holding ``num_slots`` token slots."""
        tail = (layout.heads_per_rank, layout.head_size)
        shapes: list[list[tuple[int, ...]]]
        if layout.name is LayoutName.LAYER_SLOT_HEAD:
            shapes = [[(num_slots, *tail)] * layout.num_layers for _ in range(layout.kv_dim)]
        else:
            shapes = [[(layout.kv_dim, num_slots, *tail)] * layout.num_layers]
        return cls(shapes, layout.dtype.torch_dtype)

    def close(self) -> None:
        """Unmap and unlink every segment (idempotent)."""
        self.tensors = []
        segments, self._segments = self._segments, []
        for seg in segments:
            with contextlib.suppress(BufferError):  # a live view keeps the mapping
                seg.close()
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
            CREATED_HERE.discard(seg._name)  # type: ignore[attr-defined]

    def __enter__(self) -> SharedKVBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

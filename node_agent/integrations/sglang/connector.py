"""SGLang's FlexKV connector interface, served by the node agent.

:class:`AgentKVConnector` has the methods and return conventions that SGLang
0.5.23's ``FlexKVRadixCache`` calls on its ``FlexKVConnector``
(``sglang/srt/mem_cache/storage/flexkv/flexkv_connector.py``), but it never
talks to a ``KVManager`` or a gloo group: every call goes to this node's agent
through :class:`node_agent.client.EngineClient`. The agents of a PP group
(operator-elected leader, epoch-fenced CurveZMQ fan-out) give every stage the
same hit and the same store verdict, so each stage's rank only talks to its own
agent. This module imports no SGLang code.

Contract, per method (``handle`` is SGLang's ``CacheRequestHandle(rid,
attempt_id)``; the agent sees ``"<rid>:<attempt_id>"``):

* ``lookup_kv(token_ids, token_mask, handle) -> (task_id, hit)``: ``hit`` is a
  whole number of pages of the tokens whose mask is True; a positive hit is held
  for ``retrieve_kv``. Any failure (no agent, timeout, error) is a miss ``(-1, 0)``.
* ``retrieve_kv(handle, slot_mapping) -> loaded``: all or nothing. It returns
  ``len(slot_mapping)`` (the held hit) or 0; never a value in between, so SGLang's
  ``0 < loaded < promised`` ``RuntimeError`` cannot happen. One exception,
  :data:`SLOTS_IN_USE` (-1): the agent's load copy did not stop (a hung device)
  and may still write the slots; they must never be freed or reused
  (``FlexKVAgentRadixCache`` keeps them allocated for the process's life).
* ``release_pending(handle)``: no load will follow; the agent drops the lookup.
* ``store_kv(handle, token_ids, kv_indices) -> task id | -1``: different lengths
  raise ``ValueError("store_kv: token_ids has N entries but kv_indices has M
  entries")`` before anything else; inputs are cut to whole pages; -1 when
  nothing is stored. A task id means the source slots stay in use until
  ``check_completed_stores`` returns the handle.
* ``check_completed_stores() -> [handle]``: handles whose store is terminal on
  every stage of the group (the agents' verdict, not gloo). If the agent is
  gone, or a store stays unreported for ``orphan_store_seconds``, its handle is
  returned too, so SGLang never keeps a radix node locked for ever.
* ``reset()``: drops held lookups and waits (bounded) for stores in flight;
  the agent's cache is kept, as SGLang's ``reset`` keeps FlexKV's.
* ``shutdown()``: closes the socket.

When the agent is absent every call degrades to a miss / not stored and the
connector retries registration every ``retry_seconds``: SGLang keeps serving
from its own radix cache.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import numpy as np

from node_agent.client import (
    AGENT_ERRORS,
    AgentHealth,
    AgentTimeoutError,
    AgentUnavailableError,
    SlotsInUseError,
)
from node_agent.vocab.layout import KVLayout
from node_agent.vocab.tokens import int64_array

log = logging.getLogger(__name__)

SLOTS_IN_USE = -1
"""``retrieve_kv``'s answer when the agent's load copy did not stop after its
timeout and abort (error type ``SlotsInUse``): it may still write the slots, which
must never be freed or reused (docs/agent.md "Call deadlines")."""
T = TypeVar("T")

#: Bound on the ``ping`` that probes a suspended agent before calls resume.
PROBE_SECONDS = 1.0


class AgentClient(Protocol):
    """The part of :class:`node_agent.client.EngineClient` the connector uses."""

    timeout: float

    def ping(self, timeout: float | None = None) -> dict[str, Any]: ...
    def register_kv_buffers(self, layout: KVLayout, buffers: Any) -> dict[str, Any]: ...
    def lookup(self, rid: str, token_ids: Any, token_mask: Any = None) -> int: ...
    def retrieve(self, rid: str, slot_mapping: Any) -> int: ...
    def store_kv(self, rid: str, token_ids: Any, kv_indices: Any) -> int: ...
    def poll_completed(self) -> list[str]: ...
    def release(self, rid: str) -> None: ...
    def release_nowait(self, rid: str) -> None: ...
    def close(self) -> None: ...


@dataclass
class _Pending:
    task_id: int
    hit: int


@dataclass
class _Store:
    handle: Hashable
    started: float


def agent_rid(handle: Hashable) -> str:
    """The request id the agent sees for SGLang's ``CacheRequestHandle``.

    Every PP stage derives the same string from the same handle, which is what
    pairs the stages' calls in the agents' group.
    """
    rid = getattr(handle, "rid", None)
    attempt = getattr(handle, "attempt_id", None)
    if rid is None or attempt is None:
        return str(handle)
    return f"{rid}:{attempt}"


class AgentKVConnector:
    """One SGLang rank's FlexKV-style connector backed by its node agent.

    ``buffers`` is what ``EngineClient.register_kv_buffers`` takes for ``layout``
    (CUDA tensors, or shared-memory handles on CPU). ``page_size`` must equal the
    agent's ``tokensPerBlock`` (the agent refuses the registration otherwise).
    Thread-safe: SGLang calls it from the scheduler thread only, but ``reset``
    may come from another.
    """

    enable_layerwise = False  # SGLang's MP (synchronous) mode only

    def __init__(self, client: AgentClient, layout: KVLayout, buffers: Any, *,
                 page_size: int, retry_seconds: float = 5.0,
                 orphan_store_seconds: float = 120.0,
                 tp_rank: int = 0, tp_size: int = 1,
                 tp_broadcast: Callable[[Any], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if page_size != layout.tokens_per_block:
            raise ValueError(
                f"page_size {page_size} differs from the layout's tokens_per_block "
                f"{layout.tokens_per_block}; run SGLang with --page-size equal to the "
                "pool's tokensPerBlock"
            )
        if retry_seconds <= 0 or orphan_store_seconds <= 0:
            raise ValueError(
                f"retry_seconds={retry_seconds} and orphan_store_seconds="
                f"{orphan_store_seconds} must both be > 0 seconds"
            )
        if tp_size > 1 and tp_broadcast is None:
            raise ValueError(
                f"tp_size={tp_size} needs tp_broadcast (TP rank 0's answers reach the other "
                "TP ranks through it, e.g. SGLang's tp_group.broadcast_object)"
            )
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} is outside tp_size={tp_size}")
        self.client = client
        self.layout = layout
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._tp_broadcast = tp_broadcast
        self.page_size = page_size
        self.retry_seconds = retry_seconds
        self.orphan_store_seconds = orphan_store_seconds
        self._buffers = buffers
        self._clock = clock
        self._lock = threading.RLock()
        self._registered = False
        self.health = AgentHealth(retry_seconds, clock=clock, log=log, name="Node agent",
                                  fallback="SGLang continues on its own radix cache",
                                  resumed="KV offload resumed")
        self._pending: dict[Hashable, _Pending] = {}
        self._stores: dict[str, deque[_Store]] = {}
        self._task_ids = itertools.count(1)

    # -- registration and degradation --------------------------------------------------

    @property
    def connected(self) -> bool:
        """True while this rank's buffers are registered and the agent answers."""
        return self._registered and not self.health.down

    def connect(self) -> bool:
        """Register the buffers now if the agent is there; True when registered.

        A ``ValueError`` (the agent refused the layout or the buffers) propagates:
        it is a configuration error, not an absent agent.
        """
        with self._lock:
            self.health.retry_now()
            return self._available(refusal_raises=True)

    def _available(self, refusal_raises: bool = False) -> bool:
        """Whether to send this call to the agent at all (:attr:`health`, the
        client's resilience policy, without a probe thread).

        After a call the agent did not serve (no agent, no answer, not ready),
        calls are answered locally (miss / not stored) until ``retry_seconds``
        passed; then the next call first probes: it registers the buffers when
        they are not registered (the agent was gone, or refused them), else
        sends a short ``ping``. A dead agent whose socket file is left behind
        would otherwise cost the client's whole timeout on every call of every
        scheduler tick.
        """
        if not self.health.should_call():
            return False
        if not self._registered:
            try:
                self.client.register_kv_buffers(self.layout, self._buffers)
            except AGENT_ERRORS as exc:
                self._degraded("register", exc)
                return False
            except ValueError as exc:
                # The agent refused this rank's layout: not served until it is
                # accepted; register again only after retry_seconds.
                self.health.failed("register", exc, down=True)
                if refusal_raises:
                    raise
                self._refused("register", exc)
                return False
            self._registered = True
            self.health.succeeded()
            return True
        if not self.health.down:
            return True
        try:
            self.client.ping(timeout=min(self.client.timeout, PROBE_SECONDS))
        except AGENT_ERRORS as exc:
            self._degraded("ping", exc)
            return False
        self.health.succeeded()
        return True

    def _degraded(self, op: str, exc: BaseException) -> None:
        """The agent did not serve ``op``: the policy stops calls for
        ``retry_seconds`` when ``exc`` means it is down; an absent agent's
        successor needs this rank's buffers registered again."""
        if self.health.failed(op, exc) and isinstance(exc, AgentUnavailableError):
            self._registered = False

    def _agent_gone(self) -> bool:
        """True when the agent's socket file is missing: no agent process can be
        reading this rank's buffers any more."""
        path = getattr(self.client, "socket_path", None)
        return path is not None and not Path(path).exists()

    def _refused(self, op: str, exc: ValueError) -> None:
        log.error("Node agent refused a call", extra={"op": op, "error": str(exc)})

    # -- tensor parallelism ----------------------------------------------------------------

    def _tp(self, leader: Callable[[], T]) -> T:
        """Run ``leader`` on TP rank 0 only and give its result to every TP rank.

        The agent serves data calls from TP rank 0 (one call moves the KV of every
        TP rank of the stage), so the other ranks take rank 0's answers; SGLang's
        TP schedulers make the same calls in the same order. A ``ValueError`` on
        rank 0 is raised on every rank. Other ranks only keep their own buffers
        registered."""
        if self.tp_size == 1:
            return leader()
        assert self._tp_broadcast is not None
        if self.tp_rank == 0:
            try:
                shared: tuple[str, Any] = ("ok", leader())
            except ValueError as exc:
                shared = ("ValueError", str(exc))
            except Exception as exc:
                shared = ("error", f"{type(exc).__name__}: {exc}")
                self._tp_broadcast(shared)
                raise
            self._tp_broadcast(shared)
        else:
            self._available()
            shared = self._tp_broadcast(None)
        kind, value = shared
        if kind == "ValueError":
            raise ValueError(value)
        if kind != "ok":
            raise RuntimeError(f"TP rank 0 failed: {value}")
        return cast(T, value)

    # -- loads --------------------------------------------------------------------------

    def lookup_kv(self, token_ids: Sequence[int] | Any, token_mask: Any = None,
                  handle: Hashable | None = None) -> tuple[int, int]:
        """``(task_id, hit)``: ``hit`` tokens (whole pages) among the masked ones can
        be loaded; the hit is held for ``retrieve_kv(handle, ...)``. ``(-1, 0)`` on a
        miss or when the agent does not serve the call. Without a handle nothing can
        be held, so the lookup is not made (SGLang's MP mode always passes one)."""
        with self._lock:
            if handle is None:
                return -1, 0
            self._pending.pop(handle, None)
            task_id, hit = self._tp(lambda: self._lookup(handle, token_ids, token_mask))
            if hit > 0:
                self._pending[handle] = _Pending(task_id, hit)
            return task_id, hit

    def _lookup(self, handle: Hashable, token_ids: Any, token_mask: Any) -> tuple[int, int]:
        if not self._available():
            return -1, 0
        rid = agent_rid(handle)
        try:
            tokens = int64_array("lookup_kv: token_ids", token_ids)
            mask = None
            if token_mask is not None:
                if hasattr(token_mask, "detach"):
                    token_mask = token_mask.detach().cpu().numpy()
                mask = np.asarray(token_mask, dtype=bool).reshape(-1)
            hit = int(self.client.lookup(rid, tokens, mask))
        except ValueError as exc:
            self._refused("lookup", exc)
            return -1, 0
        except AGENT_ERRORS as exc:
            self._degraded("lookup", exc)
            return -1, 0
        if hit <= 0:
            return -1, 0
        if hit % self.page_size:
            # The agent matches whole blocks of tokensPerBlock == page_size, so this
            # means a misconfiguration; a partial page can never be loaded.
            log.error("Agent hit is not a whole number of pages; treated as a miss",
                      extra={"rid": rid, "hit": hit, "pageSize": self.page_size})
            self._release(rid)
            return -1, 0
        return next(self._task_ids), hit

    def retrieve_kv(self, handle: Hashable, slot_mapping: Any) -> int:
        """Load the held hit into ``slot_mapping`` (one slot per hit token).

        Returns ``len(slot_mapping)`` when every stage of the group loaded, else 0
        (the slots hold garbage and may be freed at once: the agent answered, or
        the client's timeout, which exceeds the agent's call bound, ran out), or
        :data:`SLOTS_IN_USE` when the agent's copy did not stop and may still write
        the slots: the caller must never free or reuse them. With
        TP, rank 0's slot mapping is used for every TP rank (SGLang's TP ranks
        allocate the same slots)."""
        with self._lock:
            pending = self._pending.pop(handle, None)
            if pending is None:
                return 0
            return self._tp(lambda: self._retrieve(handle, pending, slot_mapping))

    def _retrieve(self, handle: Hashable, pending: _Pending, slot_mapping: Any) -> int:
        if not self._available():
            return 0
        rid = agent_rid(handle)
        try:
            slots = int64_array("retrieve_kv: slot_mapping", slot_mapping)
        except ValueError as exc:
            self._refused("retrieve", exc)
            self._release(rid)
            return 0
        if len(slots) != pending.hit:
            log.error("retrieve_kv got a slot mapping that does not match the held hit",
                      extra={"rid": rid, "slots": len(slots), "hit": pending.hit})
            self._release(rid)
            return 0
        try:
            loaded = int(self.client.retrieve(rid, slots))
        except ValueError as exc:
            self._refused("retrieve", exc)
            return 0
        except SlotsInUseError as exc:
            log.error("The agent's load copy may still write the request's slots; they "
                      "are kept out of use", extra={"rid": rid, "slots": len(slots),
                                                    "error": str(exc)})
            return SLOTS_IN_USE
        except AGENT_ERRORS as exc:
            self._degraded("retrieve", exc)
            return 0
        # All or nothing: anything but the whole promised span counts as nothing.
        return loaded if loaded == len(slots) else 0

    def release_pending(self, handle: Hashable) -> None:
        """No load will follow ``lookup_kv(handle)``: the agent drops the held lookup.

        Forwarded to the agent on every call (not only when a hit is held), so every
        stage makes the same calls for a request whatever its local state."""
        with self._lock:
            self._pending.pop(handle, None)
            self._tp(lambda: self._release_now(handle))

    def _release_now(self, handle: Hashable) -> None:
        if self._available():
            self._release(agent_rid(handle))

    def _release(self, rid: str) -> None:
        try:
            # No answer to wait for where the agent handles releases in order.
            self.client.release_nowait(rid)
        except (ValueError, *AGENT_ERRORS) as exc:
            log.debug("Release not delivered", extra={"rid": rid, "error": str(exc)})

    def cancel_prefetch(self, handle: Hashable) -> None:
        """SGLang drops a prefetch; there is none here beyond the held lookup."""
        with self._lock:
            self._pending.pop(handle, None)

    def prefetch_async(self, handle: Hashable, token_ids: Sequence[int]) -> int:
        """No separate prefetch: the agent's tiers are read on ``retrieve_kv``."""
        return -1

    def check_prefetch_progress(self, handle: Hashable) -> bool:
        """Always done (no prefetch runs)."""
        return True

    def drain_launched_loads(self, threshold: int = 100) -> None:
        """Nothing to drain: every load is synchronous and ends inside its call."""

    # -- stores -------------------------------------------------------------------------

    def store_kv(self, handle: Hashable, token_ids: Sequence[int] | Any,
                 kv_indices: Any) -> int:
        """Store the KV of ``token_ids`` held in slots ``kv_indices`` (parallel arrays).

        Raises ``ValueError`` naming both counts when the lengths differ, before
        anything is aligned, sent or written. Returns the group's task id, or -1 when
        nothing is stored (aligned length 0, nothing new, agent absent, a failure).
        """
        n = len(token_ids)
        if n != len(kv_indices):
            raise ValueError(
                f"store_kv: token_ids has {n} entries but kv_indices "
                f"has {len(kv_indices)} entries"
            )
        aligned = (n // self.page_size) * self.page_size
        if aligned == 0:
            return -1
        with self._lock:
            task_id, track = self._tp(lambda: self._store(handle, token_ids, kv_indices,
                                                          aligned))
            if track:
                rid = agent_rid(handle)
                self._stores.setdefault(rid, deque()).append(_Store(handle, self._clock()))
            return task_id

    def _store(self, handle: Hashable, token_ids: Any, kv_indices: Any,
               aligned: int) -> tuple[int, bool]:
        if not self._available():
            return -1, False
        ids = int64_array("store_kv: token_ids", token_ids)[:aligned]
        idx = int64_array("store_kv: kv_indices", kv_indices)[:aligned]
        try:
            task_id = int(self.client.store_kv(agent_rid(handle), ids, idx))
        except AgentTimeoutError as exc:
            # No answer: the agent may still read the slots until it reports the
            # rid. Keep them locked like a launched store (see check_completed_stores).
            self._degraded("store_kv", exc)
            return next(self._task_ids), True
        except AGENT_ERRORS as exc:
            self._degraded("store_kv", exc)
            return -1, False
        return task_id, task_id >= 0

    def check_completed_stores(self) -> list[Hashable]:
        """Handles whose stores are terminal on every stage (their source slots are
        free again). Non-blocking apart from one bounded round trip to the agent, made
        only while stores are in flight."""
        with self._lock:
            if not self._stores:
                return []
            return self._pop(self._tp(self._done_rids))

    def _done_rids(self, counted: Counter[str] | None = None) -> list[str]:
        """TP rank 0: the rids (one per finished store) that may be reported now,
        beyond ``counted``: reported by the agent, all of them when the agent process
        is gone (its socket file removed), or older than ``orphan_store_seconds``."""
        counted = counted or Counter()
        left = {r: len(q) - counted[r] for r, q in self._stores.items()}
        polled: list[str] = []
        if self._available():
            try:
                polled = self.client.poll_completed()
            except AGENT_ERRORS as exc:
                self._degraded("poll_completed", exc)
        if self._agent_gone():
            return [r for r, n in left.items() for _ in range(n)]
        out: list[str] = []
        for rid in polled:
            if left.get(rid, 0) > 0:
                out.append(rid)
                left[rid] -= 1
        limit = self._clock() - self.orphan_store_seconds
        for rid, queue in self._stores.items():
            for store in list(queue)[len(queue) - left[rid]:]:
                if store.started > limit:
                    break
                log.warning("Store never reported by the agent; releasing its slots",
                            extra={"rid": rid, "afterSeconds": self.orphan_store_seconds})
                out.append(rid)
        return out

    def _pop(self, rids: list[str]) -> list[Hashable]:
        """Stop tracking one store per rid (oldest first); their handles."""
        done: list[Hashable] = []
        for rid in rids:
            queue = self._stores.get(rid)
            if queue:
                done.append(queue.popleft().handle)
                if not queue:
                    del self._stores[rid]
        return done

    def stores_in_flight(self) -> int:
        """Stores not yet reported by ``check_completed_stores``."""
        with self._lock:
            return sum(len(q) for q in self._stores.values())

    # -- lifecycle ----------------------------------------------------------------------

    def reset(self) -> list[Hashable]:
        """SGLang's ``flush_cache``: drop held lookups, then wait up to the client's
        timeout for stores in flight. Returns the handles that completed; the
        agent's cache is kept (SGLang's ``reset`` does not flush FlexKV either)."""
        with self._lock:
            held = list(self._pending)
            self._pending.clear()
            return self._pop(self._tp(lambda: self._reset(held)))

    def _reset(self, held: list[Hashable]) -> list[str]:
        for handle in held:
            self._release_now(handle)
        total = sum(len(q) for q in self._stores.values())
        done: list[str] = []
        deadline = self._clock() + self.client.timeout
        while len(done) < total and self._clock() < deadline:
            done += self._done_rids(Counter(done))
            if len(done) < total:
                time.sleep(0.01)
        if len(done) < total:
            log.warning("Flush went ahead with stores still in flight",
                        extra={"stores": total - len(done)})
            left = Counter({r: len(q) for r, q in self._stores.items()}) - Counter(done)
            done += list(left.elements())
        return done

    def shutdown(self) -> None:
        """Close the agent socket (SGLang's exit)."""
        with self._lock:
            self._pending.clear()
            self._stores.clear()
            self.client.close()

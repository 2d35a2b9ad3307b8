"""Bounded, thread-safe tables that pair engine calls with fan-out messages.

Keys are ``(rid, kind, n)``: the n-th call of a kind for a request since its
release, so every stage pairs its own n-th ``store_kv`` / ``lookup`` with the
leader's n-th decision whichever arrives first. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from node_agent.pp.messages import Ack, Kind

Key = tuple[str, Kind, int]
V = TypeVar("V")


class CallCounter:
    """Per-request call numbers by kind (thread-safe, bounded by ``limit`` rids)."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._next: OrderedDict[tuple[str, Kind], int] = OrderedDict()
        self._limit = limit

    def next(self, rid: str, kind: Kind) -> int:
        """The number of this call (0 for the first since release)."""
        with self._lock:
            k = (rid, kind)
            n = self._next.get(k, 0)
            self._next[k] = n + 1
            self._next.move_to_end(k)
            while len(self._next) > self._limit:
                self._next.popitem(last=False)
            return n

    def release(self, rid: str) -> None:
        """Forget ``rid``'s counters."""
        with self._lock:
            for kind in Kind:
                self._next.pop((rid, kind), None)


class Mailbox(Generic[V]):
    """Values keyed by :data:`Key`, delivered to at most one waiter each.

    ``put`` stores (bounded: the oldest entries expire first); ``take`` waits up
    to ``timeout`` for a key and removes it; ``abandon`` records that nobody will
    wait for a key any more, so a late ``put`` is refused (returns False) and
    the caller answers it (a failure ack). ``fail_waiters`` wakes every waiter
    with nothing (the stream broke).
    """

    def __init__(self, limit: int) -> None:
        self._cond = threading.Condition()
        self._items: OrderedDict[Key, V] = OrderedDict()
        self._abandoned: OrderedDict[Key, None] = OrderedDict()
        self._limit = limit
        self._epoch = 0

    def put(self, key: Key, value: V) -> bool:
        """Deliver ``value``; False when its waiter already gave up."""
        with self._cond:
            if key in self._abandoned:
                del self._abandoned[key]
                return False
            self._items[key] = value
            while len(self._items) > self._limit:
                self._items.popitem(last=False)
            self._cond.notify_all()
            return True

    def take(self, key: Key, timeout: float) -> V | None:
        """Wait for ``key`` (bounded); None on timeout or when waiters were failed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            start_epoch = self._epoch
            while key not in self._items:
                left = deadline - time.monotonic()
                if left <= 0 or self._epoch != start_epoch:
                    self._abandon(key)
                    return None
                self._cond.wait(left)
            return self._items.pop(key)

    def abandon(self, key: Key) -> None:
        """Nobody will take ``key``: drop it now or refuse it when it comes."""
        with self._cond:
            self._abandon(key)

    def _abandon(self, key: Key) -> None:
        if self._items.pop(key, None) is None:
            self._abandoned[key] = None
            while len(self._abandoned) > self._limit:
                self._abandoned.popitem(last=False)

    def discard_rid(self, rid: str) -> list[V]:
        """Remove and return every value of ``rid``."""
        with self._cond:
            keys = [k for k in self._items if k[0] == rid]
            return [self._items.pop(k) for k in keys]

    def fail_waiters(self) -> list[V]:
        """Wake every waiter empty-handed and drop every stored value (returned)."""
        with self._cond:
            self._epoch += 1
            values = list(self._items.values())
            self._items.clear()
            self._abandoned.clear()
            self._cond.notify_all()
            return values


@dataclass
class AckCollector:
    """Acks of one task from the followers ``expected``; completes when all
    answered or one failed."""

    expected: frozenset[int]
    acks: dict[int, Ack] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, ack: Ack) -> None:
        """Record a follower's ack (ignored for ranks not expected)."""
        with self.cond:
            if ack.rank in self.expected:
                self.acks[ack.rank] = ack
                self.cond.notify_all()

    def failed(self) -> list[Ack]:
        """Failure acks so far."""
        return [a for a in self.acks.values() if not a.ok]

    def done(self) -> bool:
        """True when every expected follower answered or one failed."""
        return bool(self.failed()) or set(self.acks) >= self.expected

    def all_ok(self) -> bool:
        """True when every expected follower acked success."""
        return set(self.acks) >= self.expected and not self.failed()

    def wait(self, timeout: float) -> bool:
        """Wait until :meth:`done` (bounded); returns :meth:`all_ok`."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            return self.all_ok()

    def missing(self) -> list[int]:
        """Ranks that have not answered."""
        return sorted(self.expected - set(self.acks))


class CompletedRids:
    """Rids whose store is terminal on every stage, until the engine polls them.

    Bounded by ``limit``: an engine that never calls ``poll_completed`` cannot
    grow it without end. On overflow the oldest rid is dropped unreported and
    ``on_drop()`` is called once per dropped rid (a metric), and
    :attr:`dropped` counts them. Thread-safe.
    """

    def __init__(self, limit: int, on_drop: Callable[[], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"CompletedRids limit={limit!r} must be >= 1")
        self._lock = threading.Lock()
        self._rids: deque[str] = deque()
        self._limit = limit
        self._on_drop = on_drop
        self.dropped = 0

    def add(self, rids: Iterable[str]) -> None:
        """Queue ``rids`` in order, dropping the oldest beyond the limit."""
        with self._lock:
            self._rids.extend(rids)
            over = len(self._rids) - self._limit
            for _ in range(max(over, 0)):
                self._rids.popleft()
            if over > 0:
                self.dropped += over
        if over > 0 and self._on_drop is not None:
            for _ in range(over):
                self._on_drop()

    def drain(self) -> list[str]:
        """Every queued rid, oldest first; the queue is then empty."""
        with self._lock:
            out = list(self._rids)
            self._rids.clear()
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._rids)

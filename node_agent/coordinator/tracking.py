"""Bounded, thread-safe tables that pair engine calls with fan-out messages.

:class:`DecisionBook` pairs a follower's engine calls with the leader's
decisions by content: a call takes only a decision of its own rid, kind and
token digest, within the same *life* of the rid (the calls between two
releases). :class:`Mailbox` holds values under a unique key ``(rid, kind, n)``
(``n`` is the leader's decision number). Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from node_agent.pp.messages import Ack, Kind

Key = tuple[str, Kind, int]
V = TypeVar("V")


class DecisionNumbers:
    """The leader's decision numbers: unique within one leader role, never reused
    (a release does not restart them), so ``(rid, kind, n)`` names one decision."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0

    def next(self) -> int:
        """A fresh decision number."""
        with self._lock:
            n = self._next
            self._next += 1
            return n


LIVES_LIMIT = 1 << 16
"""Rids whose life numbers a stage remembers while nothing of theirs is pending
(least recently used first out; see :class:`DecisionBook` and the leader's
:class:`RidLives`)."""


class RidLives:
    """The leader's life of each rid: how many times its engine released the rid
    while this leader role ran. Every decision carries it, so a follower pairs a
    call with a decision of the same life even when a RELEASE was lost in a gap.

    Bounded by ``limit`` rids (least recently used out): a rid forgotten here
    restarts at life 0, whose decisions a follower that remembers a later life
    refuses (a miss, never another life's data). Not thread-safe: the leader
    uses it under its decision lock.
    """

    def __init__(self, limit: int = LIVES_LIMIT) -> None:
        self._lives: OrderedDict[str, int] = OrderedDict()
        self._limit = limit

    def life(self, rid: str) -> int:
        """The current life of ``rid`` (0 until its first release)."""
        return self._lives.get(rid, 0)

    def release(self, rid: str) -> int:
        """End the current life of ``rid``; returns the next one."""
        life = self._lives.pop(rid, 0) + 1
        self._lives[rid] = life
        while len(self._lives) > self._limit:
            self._lives.popitem(last=False)
        return life


@dataclass
class _Life:
    """One life of a rid on a follower: the leader decisions of that life not
    yet taken, the calls of that life that gave up waiting, and the content of
    decisions the leader ended before any call took them (``withdrawn``)."""

    pending: list[tuple[Kind, int, Any]] = field(default_factory=list)
    gave_up: list[tuple[Kind, int]] = field(default_factory=list)
    withdrawn: list[tuple[Kind, int]] = field(default_factory=list)

    def held(self) -> bool:
        return bool(self.pending or self.gave_up or self.withdrawn)


@dataclass
class _RidBook:
    stream_life: int = 0
    """The latest leader life of the rid seen (on its decisions and RELEASEs)."""
    local_life: int = 0
    """This stage's life of the rid in the leader's numbering: the engine's
    releases of the rid, shifted when a new leader process restarts the count."""
    lives: dict[int, _Life] = field(default_factory=dict)
    waiters: int = 0
    """Calls waiting in :meth:`DecisionBook.take` (the book must outlive them)."""

    def life(self, k: int) -> _Life:
        return self.lives.setdefault(k, _Life())

    def idle(self) -> bool:
        return not self.waiters and not any(lf.held() for lf in self.lives.values())


@dataclass
class Taken(Generic[V]):
    """What :meth:`DecisionBook.take` found: the paired value (or None), the
    older decisions of the same kind it skipped (never applied: the caller
    answers them with a failure ack), and whether the call ended unpaired while
    a decision of the same rid and kind but another digest was pending (a
    mismatch)."""

    value: V | None
    skipped: list[V]
    mismatch: bool = False
    withdrawn: bool = False
    """The call's decision was ended by the leader before it was taken
    (:meth:`DecisionBook.withdraw`): the call answers at once, nothing applied."""


class DecisionBook(Generic[V]):
    """A follower's pending leader decisions, paired with engine calls by content.

    Each rid has *lives*, numbered by the leader: every decision carries the
    leader's life of its rid (its engine's releases of the rid), and this
    stage's own ``release`` starts its next local life. A call of local life
    ``k`` takes only a decision of life ``k`` with its own kind and digest (the
    oldest such). So a follower that lags behind a leader that already released
    and reused a rid still pairs each call with the decision made for it, even
    when the stream's RELEASE was lost in a gap, and a follower ahead of its
    leader refuses decisions of lives it already ended. Call order only orders:
    older decisions of the same kind that a call passes over are handed back
    (skipped), never applied.

    The life numbers of a rid outlive a resync (:meth:`fail_waiters`) and its
    pending decisions: a rid with nothing pending keeps them in a table of at
    most ``lives_limit`` rids (least recently used out; a forgotten rid restarts
    at life 0 here, so its calls miss until the leader's numbers come back
    down, never pair with another life). A new leader process numbers lives
    from 0: :meth:`rebase` moves this stage's lives to its numbering.

    ``gave_up``: a call that timed out marks its (kind, digest) in its life, so
    the late decision is refused on arrival (``deliver`` returns False) and the
    leader gets a failure ack at once. :meth:`withdraw`: the leader ended a
    decision no call took yet (its blocks may hold other content soon): it is
    dropped from whatever life it waits for, and the call of that life and
    content answers at once, never applies it. ``release`` ends the local life: its
    pending decisions and marks are dropped (handed back). Bounded: at most
    ``limit`` rids with pending decisions and ``limit`` pending decisions; the
    oldest rid is evicted first (its decisions handed back by
    ``take_evicted``; its life numbers kept).
    """

    def __init__(self, limit: int, lives_limit: int = LIVES_LIMIT) -> None:
        self._cond = threading.Condition()
        self._rids: OrderedDict[str, _RidBook] = OrderedDict()
        self._limit = limit
        self._count = 0
        self._epoch = 0
        self._evicted: list[V] = []
        self._known: OrderedDict[str, tuple[int, int]] = OrderedDict()
        """rid -> (stream_life, local_life) of rids with nothing pending."""
        self._known_limit = lives_limit

    def _book(self, rid: str) -> _RidBook:
        b = self._rids.get(rid)
        if b is None:
            b = self._rids[rid] = _RidBook()
            lives = self._known.pop(rid, None)
            if lives is not None:
                b.stream_life, b.local_life = lives
        self._rids.move_to_end(rid)
        return b

    def _remember(self, rid: str, b: _RidBook) -> None:
        """Keep the life numbers of ``rid`` (its book leaves the active table)."""
        if b.stream_life or b.local_life:
            self._known[rid] = (b.stream_life, b.local_life)
            self._known.move_to_end(rid)
            while len(self._known) > self._known_limit:
                self._known.popitem(last=False)

    def _gc(self, rid: str) -> None:
        b = self._rids.get(rid)
        if b is not None:
            for k in [k for k, lf in b.lives.items() if not lf.held()]:
                del b.lives[k]
            if b.idle():
                del self._rids[rid]
                self._remember(rid, b)

    def _bound(self) -> None:
        while self._rids and (len(self._rids) > self._limit or self._count > self._limit):
            rid, b = self._rids.popitem(last=False)
            for lf in b.lives.values():
                self._count -= len(lf.pending)
                self._evicted.extend(v for _, _, v in lf.pending)
            self._remember(rid, b)

    def deliver(self, rid: str, kind: Kind, digest: int, life: int, value: V) -> bool:
        """A decision from the stream, made in the leader's life ``life`` of
        ``rid``; False when no call of this stage will take it (its life already
        ended here, or its call gave up): answer it now."""
        with self._cond:
            b = self._book(rid)
            b.stream_life = max(b.stream_life, life)
            if life < b.local_life:
                self._gc(rid)
                return False
            lf = b.life(life)
            if (kind, digest) in lf.gave_up:
                lf.gave_up.remove((kind, digest))
                self._gc(rid)
                return False
            lf.pending.append((kind, digest, value))
            self._count += 1
            self._bound()
            self._cond.notify_all()
            return True

    def stream_release(self, rid: str, life: int) -> None:
        """The leader released ``rid`` (in stream order): its next decisions
        belong to its life ``life``."""
        with self._cond:
            b = self._book(rid)
            b.stream_life = max(b.stream_life, life)
            self._gc(rid)

    def release(self, rid: str) -> list[V]:
        """This stage's engine released ``rid``: end its local life; returns the
        decisions of that life no call took (to be answered with failure acks)."""
        with self._cond:
            b = self._book(rid)
            lf = b.lives.pop(b.local_life, None)
            b.local_life += 1
            dropped: list[V] = []
            if lf is not None:
                dropped = [v for _, _, v in lf.pending]
                self._count -= len(dropped)
            self._gc(rid)
            self._cond.notify_all()
            return dropped

    def lives(self, rid: str) -> tuple[int, int]:
        """``(leader life seen, local life)`` of ``rid`` (status and tests)."""
        with self._cond:
            b = self._rids.get(rid)
            if b is not None:
                return b.stream_life, b.local_life
            return self._known.get(rid, (0, 0))

    def take(self, rid: str, kind: Kind, digest: int, timeout: float) -> Taken[V]:
        """Wait (bounded) for the decision of this call: same rid, kind, digest,
        life. On timeout the call is marked as given up (see class docstring)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            start_epoch = self._epoch
            b = self._book(rid)
            life = b.local_life
            b.waiters += 1
            try:
                return self._take(rid, kind, digest, deadline, start_epoch, b, life)
            finally:
                b.waiters -= 1
                self._gc(rid)

    def _take(self, rid: str, kind: Kind, digest: int, deadline: float, start_epoch: int,
              b: _RidBook, life: int) -> Taken[V]:
        """:meth:`take` with the condition held; ``b`` is kept while it waits."""
        while True:
            lf = b.lives.get(life)
            if lf is not None:
                if (kind, digest) in lf.withdrawn:
                    lf.withdrawn.remove((kind, digest))
                    self._gc(rid)
                    return Taken(None, [], withdrawn=True)
                for i, (k, dg, v) in enumerate(lf.pending):
                    if k is kind and dg == digest:
                        skipped = [x for kk, _, x in lf.pending[:i] if kk is kind]
                        lf.pending = [p for j, p in enumerate(lf.pending)
                                      if j > i or (j < i and p[0] is not kind)]
                        self._count -= 1 + len(skipped)
                        self._gc(rid)
                        return Taken(v, skipped)
            left = deadline - time.monotonic()
            if left <= 0 or self._epoch != start_epoch or \
                    self._rids.get(rid) is not b or b.local_life != life:
                break
            self._cond.wait(left)
        mismatch = False
        if self._epoch == start_epoch and self._rids.get(rid) is b and b.local_life == life:
            lf = b.life(life)
            mismatch = any(k is kind for k, _, _ in lf.pending)
            lf.gave_up.append((kind, digest))
            while len(lf.gave_up) > self._limit:
                lf.gave_up.pop(0)
        self._gc(rid)
        return Taken(None, [], mismatch)

    def withdraw(self, rid: str, kind: Kind, match: Callable[[V], bool]) -> bool:
        """The leader ended a decision of ``rid`` and ``kind`` (a failed RESULT, a
        CANCEL): drop the pending ones ``match`` selects, whatever life they wait
        for, so no later call applies them (their blocks may already hold other
        content). The call of that life and content takes the withdrawal instead
        and answers at once (:attr:`Taken.withdrawn`). True when one was pending."""
        with self._cond:
            b = self._rids.get(rid)
            if b is None:
                return False
            found = False
            for lf in b.lives.values():
                keep = []
                for p in lf.pending:
                    if p[0] is kind and match(p[2]):
                        found = True
                        self._count -= 1
                        lf.withdrawn.append((kind, p[1]))
                        while len(lf.withdrawn) > self._limit:
                            lf.withdrawn.pop(0)
                    else:
                        keep.append(p)
                lf.pending = keep
            if found:
                self._gc(rid)
                self._cond.notify_all()
            return found

    def take_evicted(self) -> list[V]:
        """Decisions dropped by the bound since the last call (answer them)."""
        with self._cond:
            out, self._evicted = self._evicted, []
            return out

    def fail_waiters(self) -> list[V]:
        """The stream broke: wake every waiter empty-handed and drop every
        pending decision and given-up mark (returned: the decisions). The life
        numbers of every rid are kept: the leader's RELEASEs lost in the gap
        show in the lives its next decisions carry."""
        with self._cond:
            self._epoch += 1
            out: list[V] = [v for b in self._rids.values() for lf in b.lives.values()
                            for _, _, v in lf.pending]
            for rid, b in self._rids.items():
                self._remember(rid, b)
            self._rids.clear()
            self._count = 0
            self._cond.notify_all()
            return out

    def rebase(self) -> list[V]:
        """A new leader process took over (it numbers every rid's lives from 0):
        :meth:`fail_waiters`, then shift every rid's local life by the old
        leader's life of it, so a life this stage has not reached yet (it lags)
        stays ahead of it and a life it already ended stays behind it."""
        with self._cond:
            out = self.fail_waiters()
            known = self._known
            self._known = OrderedDict()
            for rid, (stream, local) in known.items():
                if local != stream:
                    self._known[rid] = (0, local - stream)
            return out


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
    first_at: float | None = None
    """When the first expected ack arrived (monotonic clock); None before."""

    def add(self, ack: Ack) -> None:
        """Record a follower's ack (ignored for ranks not expected)."""
        with self.cond:
            if ack.rank in self.expected:
                self.acks[ack.rank] = ack
                if self.first_at is None:
                    self.first_at = time.monotonic()
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

    def __init__(self, limit: int, on_drop: Callable[[], None] | None = None,
                 on_add: Callable[[], None] | None = None) -> None:
        """``on_add()`` is called (outside the lock) after every :meth:`add` that
        queued a rid: the completion notification of whoever waits for rids."""
        if limit < 1:
            raise ValueError(f"CompletedRids limit={limit!r} must be >= 1")
        self._lock = threading.Lock()
        self._rids: deque[str] = deque()
        self._limit = limit
        self._on_drop = on_drop
        self._on_add = on_add
        self.dropped = 0

    def add(self, rids: Iterable[str]) -> None:
        """Queue ``rids`` in order, dropping the oldest beyond the limit."""
        with self._lock:
            before = len(self._rids)
            self._rids.extend(rids)
            added = len(self._rids) > before
            over = len(self._rids) - self._limit
            for _ in range(max(over, 0)):
                self._rids.popleft()
            if over > 0:
                self.dropped += over
        if over > 0 and self._on_drop is not None:
            for _ in range(over):
                self._on_drop()
        if added and self._on_add is not None:
            self._on_add()

    def drain(self) -> list[str]:
        """Every queued rid, oldest first; the queue is then empty."""
        with self._lock:
            out = list(self._rids)
            self._rids.clear()
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._rids)

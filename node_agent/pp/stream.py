"""The ordered decision stream of one PP group, leader side and follower side.

Leader (:class:`LeaderStream`): numbers every decision with ``seq`` (1, 2, ...
within its epoch), encodes it once and sends it to every *synced* follower.
A follower becomes synced by sending HELLO and receiving SYNC (``seq`` = the
last stream seq, so the follower continues at ``seq + 1``). When the group
cache may already hold blocks the new follower lacks (the leader is
``dirty``), the leader first flushes the group (``flush`` callback: reset its
backend and broadcast RESET), so every stage again holds the same blocks.
Heartbeats carry the last seq so a follower notices a lost tail.

Batching: a stream message broadcast within ``coalesce_seconds`` of the
previous one is queued; the queue goes out as one batch frame when it holds
``max_batch`` messages, when the flusher thread wakes (right after the window),
or before any heartbeat or SYNC (whose seq must not run ahead of what was sent).
A lone message is sent at once, so paced decisions pay no extra latency. The
follower handles each message of a batch exactly as if it had come alone.

Follower (:class:`FollowerStream`): accepts stream messages only of its
epoch, strictly at ``last + 1``; older epochs are dropped (``stale_epoch``),
repeats dropped (``duplicate``), and a jump makes it unsynced (``gap``): it
drops everything until the leader's SYNC answers its HELLO, never guessing.
Leader silence for ``leader_timeout`` also makes it unsynced.

Incarnations: every leader stream has a random ``incarnation`` stamped on each
message it sends, beside (group, epoch, seq). A follower remembers the
incarnation it synced with. A message of another incarnation (a leader process
restarted under the same epoch, at the same or another address) makes it
unsynced at once and it asks the view's leader endpoint for a SYNC; until a
SYNC arrives it reports itself not synced. The incarnation of that SYNC is
followed from then on: if it is a new one, the follower first flushes its
local state (``on_new_leader``); every other incarnation seen is *left*, and
its messages are dropped (``stale_incarnation``) from then on.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.metrics import AgentMetrics
from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import Sender
from node_agent.pp.messages import (
    MAX_BATCH,
    Ack,
    Body,
    Envelope,
    Heartbeat,
    Hello,
    Message,
    Op,
    Sync,
    encode,
    pack_batch,
)

log = logging.getLogger(__name__)

DEFAULT_COALESCE_SECONDS = 50e-6
"""A stream message broadcast within this time of the previous one is queued and
sent with the messages that follow it as one batch frame (0 disables batching)."""
DEFAULT_MAX_BATCH = 64
"""A batch is sent as soon as it holds this many messages."""


class StreamMetrics:
    """Records fan-out drops and lag into :class:`AgentMetrics` when given one,
    and keeps local counters for ``status()`` either way."""

    def __init__(self, group: str, metrics: AgentMetrics | None) -> None:
        self.group = group
        self.metrics = metrics
        if metrics is not None:
            metrics.init_group(group)  # every drop reason and mismatch kind at 0
        self.dropped: dict[str, int] = {}
        self.mismatched: dict[str, int] = {}
        self.epoch_refused: dict[str, int] = {}

    def cache_epoch_refused(self, kind: str, count: int = 1) -> None:
        """Count ``count`` decisions (``put``, ``get``) or remote moves
        (``fetch``, ``write``) refused for being of another cache epoch."""
        self.epoch_refused[kind] = self.epoch_refused.get(kind, 0) + count
        if self.metrics is not None:
            self.metrics.cache_epoch_refused.labels(group=self.group, kind=kind).inc(count)

    def mismatch(self, kind: str) -> None:
        """Count one engine call that found only decisions for other tokens."""
        self.mismatched[kind] = self.mismatched.get(kind, 0) + 1
        if self.metrics is not None:
            self.metrics.fanout_mismatch.labels(group=self.group, kind=kind).inc()

    def drop(self, reason: str) -> None:
        """Count one dropped message."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.fanout_dropped.labels(group=self.group, reason=reason).inc()

    def completed_dropped(self) -> None:
        """Count one completed rid dropped before the engine polled it."""
        if self.metrics is not None:
            self.metrics.completed_dropped.labels(group=self.group).inc()

    def step_down(self) -> None:
        """Count one leader step-down (a newer epoch was seen)."""
        if self.metrics is not None:
            self.metrics.leader_step_downs.labels(group=self.group).inc()

    def lag(self, seconds: float) -> None:
        """Observe decision-sent to applied latency."""
        if self.metrics is not None:
            self.metrics.fanout_lag_seconds.labels(group=self.group).observe(max(seconds, 0.0))


@dataclass
class _Peer:
    rank: int
    sender: Sender
    synced: bool = False
    session: int = -1
    gen: int = 0
    sync_sent_at: float = 0.0


class LeaderStream:
    """Leader side of a group's stream for one epoch (see module docstring).

    ``flush(reason)`` must reset the leader's backend and call
    :meth:`broadcast` with a RESET; it is called (from the server thread) when a
    follower must be brought in while the group cache is ``dirty``.
    ``on_ack`` receives follower acks of this epoch and this leader incarnation
    (an ack stamped with another is dropped as ``stale_incarnation``).
    ``on_newer_epoch(epoch)`` is called when a follower's HELLO or ACK carries a
    newer epoch (this leader is stale and must step down).
    """

    def __init__(
        self,
        group: str,
        epoch: int,
        keys: CurveKeys | None,
        stats: StreamMetrics,
        flush: Callable[[str], None],
        on_ack: Callable[[Ack], None],
        heartbeat_interval: float = 0.1,
        on_newer_epoch: Callable[[int], None] | None = None,
        coalesce_seconds: float = DEFAULT_COALESCE_SECONDS,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        self.group = group
        self.epoch = epoch
        self._on_newer_epoch = on_newer_epoch
        self._keys = keys
        self._stats = stats
        self._flush = flush
        self._on_ack = on_ack
        self.incarnation = secrets.randbits(62) + 1
        """This leader stream instance; stamped on every message it sends."""
        self._lock = threading.RLock()
        self._peers: dict[int, _Peer] = {}
        self.seq = 0
        self.dirty = False
        self._hb_interval = heartbeat_interval
        self._resync_after = max(1.0, 10 * heartbeat_interval)
        self._stop = threading.Event()
        self._window = coalesce_seconds
        self._max_batch = max(1, min(max_batch, MAX_BATCH))
        self._outbox: list[bytes] = []
        self._last_broadcast = 0.0
        self._pending = threading.Event()
        self.batches = 0
        """Batch frames sent (each carries 2 or more stream messages)."""
        self._hb = threading.Thread(target=self._heartbeats, name=f"hb-{group}", daemon=True)
        self._hb.start()
        self._flusher = threading.Thread(target=self._flush_loop, name=f"flush-{group}",
                                         daemon=True)
        if self._window > 0:
            self._flusher.start()

    # -- membership -------------------------------------------------------------------

    def set_followers(self, endpoints: dict[int, str]) -> None:
        """Connect to exactly these followers (rank -> fan-out endpoint)."""
        with self._lock:
            for rank in list(self._peers):
                p = self._peers[rank]
                if endpoints.get(rank) != p.sender.endpoint:
                    p.sender.close()
                    del self._peers[rank]
            for rank, ep in endpoints.items():
                if rank not in self._peers:
                    self._peers[rank] = _Peer(rank, Sender(ep, self._keys))

    def peer(self, rank: int) -> Sender | None:
        """The sender to ``rank`` (tests use it to inject faults)."""
        with self._lock:
            p = self._peers.get(rank)
            return None if p is None else p.sender

    @property
    def follower_ranks(self) -> list[int]:
        """Ranks this leader fans out to."""
        with self._lock:
            return sorted(self._peers)

    def all_synced(self) -> bool:
        """True when every follower is synced (decisions can reach all stages)."""
        with self._lock:
            return all(p.synced for p in self._peers.values())

    def unsynced_ranks(self) -> list[int]:
        """Followers not synced (decisions cannot reach them)."""
        with self._lock:
            return sorted(r for r, p in self._peers.items() if not p.synced)

    def drop(self, reason: str) -> None:
        """Count a message the leader dropped (for example from another leader)."""
        self._stats.drop(reason)

    def synced_count(self) -> int:
        """Followers currently synced."""
        with self._lock:
            return sum(p.synced for p in self._peers.values())

    # -- sending -------------------------------------------------------------------------

    def broadcast(self, op: Op, body: Body | Callable[[], Body]) -> int:
        """Send one stream message to every synced follower; returns its seq.

        ``body`` may be a function that builds it: it is called only when a
        follower is synced (or messages are queued for one). With none, the
        message would reach nobody (a follower that syncs later continues after
        the SYNC's seq and never sees it), so it is neither built nor encoded;
        its seq is used all the same.

        A follower whose queue is full is marked unsynced (it will see the gap
        through heartbeats and resync). The group becomes ``dirty`` after a PUT.
        """
        with self._lock:
            self.seq += 1
            if op is Op.PUT:
                self.dirty = True
            elif op is Op.RESET:
                self.dirty = False
            if not self._outbox and not any(p.synced for p in self._peers.values()):
                return self.seq
            if callable(body):
                body = body()
            frame = encode(Envelope(op, self.group, self.epoch, self.seq,
                                    incarnation=self.incarnation), body)[0]
            now = time.monotonic()
            burst = now - self._last_broadcast < self._window
            self._last_broadcast = now
            if not self._outbox and not burst:
                self._send_to_synced(frame)
            else:
                self._outbox.append(frame)
                if len(self._outbox) >= self._max_batch:
                    self._send_outbox()
                elif not self._pending.is_set():
                    # Once per flusher cycle: setting a set Event still takes its
                    # lock and notifies, a cost on every message of a burst.
                    self._pending.set()
            return self.seq

    def _send_outbox(self) -> None:
        """Send the queued stream messages as one frame (lock held)."""
        if not self._outbox:
            return
        queued, self._outbox = self._outbox, []
        if len(queued) == 1:
            self._send_to_synced(queued[0])
        else:
            self.batches += 1
            self._send_to_synced(pack_batch(queued))

    def _send_to_synced(self, frame: bytes) -> None:
        for p in self._peers.values():
            if p.synced and not p.sender.send([frame]):
                p.synced = False
                log.warning("Fan-out queue full, follower must resync",
                            extra={"group": self.group, "rank": p.rank})

    def flush(self) -> None:
        """Send every queued stream message now."""
        with self._lock:
            self._send_outbox()

    def _flush_loop(self) -> None:
        # Waits are bounded so close() is noticed; a queued message waits at most
        # the coalescing window plus thread scheduling.
        while not self._stop.is_set():
            if not self._pending.wait(0.25):
                continue
            self._pending.clear()
            time.sleep(self._window)  # let a burst fill the batch
            with self._lock:
                self._send_outbox()

    def _heartbeats(self) -> None:
        while not self._stop.wait(self._hb_interval):
            with self._lock:
                self._send_outbox()  # the heartbeat's seq must not run ahead of the stream
                frames = encode(Envelope(Op.HEARTBEAT, self.group, self.epoch, self.seq,
                                         incarnation=self.incarnation), Heartbeat())
                for p in self._peers.values():
                    p.sender.send(frames)

    # -- receiving -----------------------------------------------------------------------

    def handle(self, msg: Message) -> None:
        """A HELLO or ACK from a follower (server thread)."""
        if msg.env.epoch != self.epoch:
            newer = msg.env.epoch > self.epoch
            self._stats.drop("future_epoch" if newer else "stale_epoch")
            if newer and self._on_newer_epoch is not None:
                self._on_newer_epoch(msg.env.epoch)
            return
        body = msg.body
        if isinstance(body, Ack):
            if msg.env.incarnation != self.incarnation:
                # An ack of another leader process's decision (this one restarted
                # at the same address): its (rid, n, task id) may collide with ours.
                self._stats.drop("stale_incarnation")
                return
            self._on_ack(body)
        elif isinstance(body, Hello):
            self._hello(body)
        else:
            self._stats.drop("malformed")

    def _hello(self, h: Hello) -> None:
        with self._lock:
            p = self._peers.get(h.rank)
            if p is None:
                log.warning("HELLO from a rank that is not a follower of this group",
                            extra={"group": self.group, "rank": h.rank})
                return
            gen = h.gen + 1
            if p.session == h.session and h.gen < p.gen:
                # Already answered. A HELLO of the gen we answered last, long after
                # our SYNC, means the SYNC was lost: answer it again.
                lost = time.monotonic() - p.sync_sent_at > self._resync_after
                if h.gen < p.gen - 1 or not lost:
                    return
                gen = p.gen
            p.synced = False
            dirty = self.dirty
        if dirty:
            # The follower cannot hold what the group cached: flush everyone. Called
            # without the stream lock: flush takes the connector's decision lock,
            # which is always taken before the stream lock.
            self._flush(f"follower rank {h.rank} (re)joined")
        with self._lock:
            p = self._peers.get(h.rank)
            if p is None:
                return
            self._send_outbox()  # everything up to the SYNC's seq goes out first
            p.session, p.gen, p.sync_sent_at = h.session, gen, time.monotonic()
            frames = encode(Envelope(Op.SYNC, self.group, self.epoch, self.seq,
                                     incarnation=self.incarnation), Sync(h.rank, gen))
            p.synced = p.sender.send(frames)
            log.info("Follower synced", extra={"group": self.group, "rank": h.rank,
                                               "seq": self.seq, "epoch": self.epoch})

    def close(self) -> None:
        """Stop heartbeats and close every sender."""
        self._stop.set()
        self._pending.set()
        for t in (self._hb, self._flusher):
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=2.0)
        with self._lock:
            self._send_outbox()
            for p in self._peers.values():
                p.sender.close()
            self._peers.clear()


class FollowerStream:
    """Follower side of a group's stream (see module docstring).

    ``apply(msg)`` is called on the server thread for each in-order stream
    message; ``on_unsynced(reason)`` when the stream breaks (pending waits must
    end); ``on_dropped(msg)`` for stream messages dropped while unsynced (so a
    PUT can be answered with a failure ack at once); ``on_new_leader(reason)``
    when another leader process took over (a new incarnation, or a new leader
    endpoint): nothing held locally was decided by it.
    """

    def __init__(
        self,
        group: str,
        rank: int,
        keys: CurveKeys | None,
        stats: StreamMetrics,
        apply: Callable[[Message], None],
        on_unsynced: Callable[[str], None],
        on_dropped: Callable[[Message], None],
        hello_interval: float = 0.25,
        leader_timeout: float = 3.0,
        on_new_leader: Callable[[str], None] | None = None,
    ) -> None:
        self.group = group
        self.rank = rank
        self._on_new_leader = on_new_leader
        self.incarnation: int | None = None
        """The leader incarnation this stage last synced with (None before)."""
        self._left: OrderedDict[int, None] = OrderedDict()
        """Incarnations this stage stopped following: their messages are dropped."""
        self._suspects: OrderedDict[int, None] = OrderedDict()
        """Other incarnations seen since the last SYNC (left once a SYNC decides)."""
        self._keys = keys
        self._stats = stats
        self._apply = apply
        self._on_unsynced = on_unsynced
        self._on_dropped = on_dropped
        self._hello_interval = hello_interval
        self._leader_timeout = leader_timeout
        self._lock = threading.RLock()
        self.epoch = -1
        self.last_seq = -1
        self.synced = False
        self._session = secrets.randbits(62)
        self._gen = 0
        self._sender: Sender | None = None
        self._last_heard = time.monotonic()
        self._last_hello = 0.0
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._tick_loop, name=f"hello-{group}", daemon=True)
        self._timer.start()

    def follow(self, epoch: int, leader_endpoint: str | None) -> None:
        """Follow the leader at ``leader_endpoint`` under ``epoch`` (view change)."""
        with self._lock:
            changed = epoch != self.epoch or (
                self._sender is None or self._sender.endpoint != leader_endpoint
            )
            if not changed:
                return
            moved = self._sender is not None and epoch == self.epoch
            if self._sender is not None:
                self._sender.close()
                self._sender = None
            self._leave_incarnation()
            self.epoch = epoch
            self._session = secrets.randbits(62)
            self._gen = 0
            self._unsync("leader or epoch changed", resync=False)
            if moved and self._on_new_leader is not None:
                self._on_new_leader("leader endpoint changed")
            if leader_endpoint is not None:
                self._sender = Sender(leader_endpoint, self._keys)
            self._last_heard = time.monotonic()
            self._send_hello()

    def _leave_incarnation(self) -> None:
        """Never follow the current incarnation again (lock held)."""
        if self.incarnation is not None:
            self._left[self.incarnation] = None
            while len(self._left) > 64:
                self._left.popitem(last=False)
        self.incarnation = None

    def send_ack(self, ack: Ack, incarnation: int) -> bool:
        """Report a task outcome to the leader (False when not connected).

        ``incarnation``: the leader process whose decision ``ack`` answers (the
        one stamped on that decision's message), not the one followed now: a
        leader that replaced it under the same epoch, maybe at the same address
        and with the same rid, ``n`` and task id, drops the ack.

        Lock-free on purpose: engine threads ack while the server thread may
        hold the stream lock waiting for their copies to end.
        """
        sender, epoch = self._sender, self.epoch
        if sender is None:
            return False
        return sender.send(encode(Envelope(Op.ACK, self.group, epoch, self.last_seq,
                                           incarnation=incarnation), ack))

    def request_resync(self, reason: str) -> None:
        """Stop applying and ask the leader for a flush point (a local fault)."""
        with self._lock:
            self._unsync(reason, resync=True)

    def drop(self, reason: str) -> None:
        """Count a message dropped by the caller."""
        self._stats.drop(reason)

    def _send_hello(self, resync: bool = False) -> None:
        if self._sender is None or self.epoch < 0:
            return
        self._last_hello = time.monotonic()
        frames = encode(
            Envelope(Op.HELLO, self.group, self.epoch, self.last_seq),
            Hello(self.rank, self._session, self._gen, resync),
        )
        self._sender.send(frames)

    def _unsync(self, reason: str, resync: bool) -> None:
        was = self.synced
        self.synced = False
        if was:
            log.warning("Fan-out stream unsynced", extra={"group": self.group, "rank": self.rank,
                                                          "reason": reason, "seq": self.last_seq})
        self._on_unsynced(reason)
        if resync:
            self._send_hello(resync=True)

    def handle(self, msg: Message) -> None:
        """A message from the leader (server thread)."""
        env = msg.env
        with self._lock:
            if env.epoch != self.epoch:
                self._stats.drop("stale_epoch" if env.epoch < self.epoch else "future_epoch")
                if env.op is Op.PUT:
                    self._on_dropped(msg)
                return
            inc = env.incarnation
            if inc in self._left:
                self._stats.drop("stale_incarnation")
                return
            if self.incarnation is not None and inc != self.incarnation:
                # Another leader process under this epoch: never mix its seqs with
                # the old one's. Ask the view's leader endpoint for a SYNC at once;
                # whichever process answers it is followed.
                self._suspects[inc] = None
                while len(self._suspects) > 64:
                    self._suspects.popitem(last=False)
                if env.op is not Op.SYNC:
                    self._stats.drop("new_incarnation")
                    if self.synced:
                        log.warning("Message from another leader incarnation, resyncing",
                                    extra={"group": self.group, "rank": self.rank,
                                           "followed": self.incarnation, "seen": inc})
                        self._unsync("message from another leader incarnation", resync=True)
                    return
            self._last_heard = time.monotonic()
            if env.op is Op.SYNC:
                assert isinstance(msg.body, Sync)
                if not self.synced and msg.body.gen == self._gen + 1:
                    previous = self.incarnation
                    for other in [previous, *self._suspects]:
                        if other is not None and other != inc:
                            self._left[other] = None
                    while len(self._left) > 64:
                        self._left.popitem(last=False)
                    self._suspects.clear()
                    self._gen = msg.body.gen
                    self.last_seq = env.seq
                    self.incarnation = inc
                    if previous is not None and previous != inc and \
                            self._on_new_leader is not None:
                        # Nothing held here was decided by this process: flush
                        # before its first stream message.
                        self._on_new_leader("leader incarnation changed")
                    self.synced = True
                    log.info("Fan-out stream synced", extra={"group": self.group,
                                                            "rank": self.rank, "seq": env.seq,
                                                            "incarnation": inc})
                return
            if env.op is Op.HEARTBEAT:
                if self.synced and env.seq > self.last_seq:
                    self._stats.drop("gap")
                    self._unsync(f"heartbeat seq {env.seq} after {self.last_seq}", resync=True)
                return
            if not env.op.in_stream:
                self._stats.drop("malformed")
                return
            if not self.synced:
                self._stats.drop("gap")
                self._on_dropped(msg)
                return
            if env.seq <= self.last_seq:
                self._stats.drop("duplicate")
                return
            if env.seq != self.last_seq + 1:
                self._stats.drop("gap")
                self._on_dropped(msg)
                self._unsync(f"seq {env.seq} after {self.last_seq}", resync=True)
                return
            self.last_seq = env.seq
            self._apply(msg)
            self._stats.lag(time.time() - env.sent_at)

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._hello_interval / 2):
            with self._lock:
                now = time.monotonic()
                if self.synced and now - self._last_heard > self._leader_timeout:
                    self._unsync("leader silent", resync=False)
                if not self.synced and now - self._last_hello >= self._hello_interval:
                    self._send_hello()

    def close(self) -> None:
        """Stop the timer and close the sender."""
        self._stop.set()
        if self._timer.is_alive():
            self._timer.join(timeout=2.0)
        with self._lock:
            if self._sender is not None:
                self._sender.close()
                self._sender = None

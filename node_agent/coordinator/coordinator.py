"""The connector of one stage of one PP group: the API the agent service wraps.

:class:`Coordinator` validates engine inputs (SGLang's FlexKV connector ``store_kv`` contract),
then hands each call to its current role: :class:`LeaderRole` when the group
view names this stage's pp rank as leader, :class:`FollowerRole` otherwise.
The role follows the view: a new leader or epoch closes the old role (its
pending calls end as "not stored" / miss) and builds the new one; a new leader
starts with a fresh backend, so every epoch starts from an empty group cache.

A group of one stage is a leader with no followers; it needs no fan-out
endpoint.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from node_agent.backend.planes import register_buffers
from node_agent.backend.replication import ReplicatedBackend, StageStore
from node_agent.coordinator.config import CoordinatorConfig
from node_agent.coordinator.errors import UnknownRequestError
from node_agent.coordinator.follower import FollowerRole
from node_agent.coordinator.inputs import prepare_lookup, prepare_store
from node_agent.coordinator.leader import LeaderRole
from node_agent.coordinator.tracking import CompletedRids
from node_agent.metrics import AgentMetrics
from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import FanoutServer
from node_agent.pp.group import GroupViewSource
from node_agent.pp.messages import Message, Op
from node_agent.pp.stream import StreamMetrics
from node_agent.vocab.group_view import GroupView

log = logging.getLogger(__name__)


class RegistrableStore(Protocol):
    """A :class:`StageStore` that engine ranks register KV buffers with."""

    def register_kv_buffers(self, rank: int, buffers: Sequence[Sequence[torch.Tensor]]) -> None:
        """Keep rank ``rank``'s buffers (validated against the store's layout)."""


BackendFactory = Callable[[], ReplicatedBackend]
"""Builds a fresh, deferred-visibility leader backend (not yet started)."""
StoreFactory = Callable[[], StageStore]
"""Builds a follower's stage store; it must also be a :class:`RegistrableStore`."""

Role = LeaderRole | FollowerRole
_ABSENT = object()


class Coordinator:
    """One stage's connector (see module docstring). Thread-safe."""

    def __init__(
        self,
        config: CoordinatorConfig,
        view: GroupViewSource,
        backend_factory: BackendFactory,
        store_factory: StoreFactory,
        keys: CurveKeys | None = None,
        metrics: AgentMetrics | None = None,
        server: FanoutServer | None = None,
        cache_epoch: Callable[[], int] | None = None,
    ) -> None:
        """``server``: an agent-wide, started :class:`FanoutServer` shared by every
        group this agent takes part in (one fan-out port per agent); this
        connector registers its group on it and never closes it. Without one, the
        connector binds its own at ``config.fanout_endpoint`` (when set).
        ``cache_epoch()``: the agent's current ``cacheEpoch`` (its remote tier's key
        epoch, switched before the flush that applies it; 0 when not given): every
        decision names it, and a stage on another epoch refuses the decision."""
        if view.view.group != config.group:
            raise ValueError(
                f"Group view is for {view.view.group!r} but the connector is for "
                f"{config.group!r}; pass the view of the same KVCacheGroup"
            )
        self.cfg = config
        self._view = view
        self._backend_factory = backend_factory
        self._store_factory = store_factory
        self._keys = keys
        self._metrics = metrics
        self._cache_epoch = cache_epoch
        self._stats = StreamMetrics(config.group, metrics)
        self._lock = threading.RLock()
        self._role: Role | None = None
        self._done = threading.Condition(threading.Lock())
        """Notified whenever some rid becomes reportable (``wait_completed``)."""
        self._completion_hook: Callable[[], None] | None = None
        self._completed = CompletedRids(config.max_completed, self._stats.completed_dropped,
                                        self._notify_completed)
        """Rids of ended roles the engine has not polled yet (see ``_end_role``)."""
        self._store: StageStore | None = None
        self._buffers: dict[int, Sequence[Sequence[torch.Tensor]]] = {}
        self._slots_by_rank: dict[int, int] = {}
        self._num_slots: int | None = None
        self._lookups: OrderedDict[str, Role | None] = OrderedDict()
        """rid -> the role that answered its last lookup, until its retrieve."""
        self._claims: OrderedDict[str, tuple[LeaderRole, int, int]] = OrderedDict()
        """rid -> the role that handed out its claimed load, the backend task it
        claimed and the claim's id (:meth:`claim_load`)."""
        self._claim_ids = itertools.count(secrets.randbelow(1 << 48) + 1)
        """Claim ids: unique across this coordinator's roles and backends (whose task
        ids start again at 1), and unlikely to repeat one of an agent this one
        replaced, so a late commit can never name a newer claim."""
        self._ended: OrderedDict[str, None] = OrderedDict()
        """Rids whose claim a release or a new lookup ended before the commit (which
        then answers False); apart from ``_claims``, so they never push a live
        claim out of its bound."""
        self._server: FanoutServer | None = server
        self._own_server = server is None
        self._leader_rank: int | None = None
        self._started = False
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Coordinator:
        """Bind the fan-out server (when configured) and take the current view's role."""
        with self._lock:
            if self._started:
                return self
            if self._server is None and self.cfg.fanout_endpoint is not None:
                self._server = FanoutServer(self.cfg.fanout_endpoint, self._keys,
                                            on_drop=lambda g, r: self._stats.drop(r)).start()
            if self._server is not None:
                self._server.register(self.cfg.group, self._dispatch)
            self._started = True
            if self._metrics is not None:
                self._metrics.pp_degraded.labels(group=self.cfg.group).set_function(
                    self._degraded_value)
            self._view.subscribe(self._on_view)
            self._on_view(self._view.view)
        return self

    def _degraded_value(self) -> float:
        role = self._role
        return 0.0 if role is not None and not self._closed and not role.degraded() else 1.0

    @property
    def fanout_endpoint(self) -> str | None:
        """The bound fan-out endpoint (after ``start``), for the group view."""
        return None if self._server is None else self._server.endpoint

    def close(self) -> None:
        """Leave the group: stop the role, the server; release tiers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._view.unsubscribe(self._on_view)
            self._end_role()
            if self._server is not None:
                self._server.unregister(self.cfg.group)
                if self._own_server:
                    self._server.close()
                self._server = None

    def _dispatch(self, msg: Message) -> None:
        role = self._role
        if role is None:
            # No role yet, or none in this view. Heartbeats carry nothing to
            # lose; anything else is counted like a drop by an unsynced follower.
            epoch = self._view.view.epoch
            if msg.env.epoch < epoch:
                self._stats.drop("stale_epoch")
            elif msg.env.epoch > epoch:
                self._stats.drop("future_epoch")
            elif msg.env.op is not Op.HEARTBEAT:
                self._stats.drop("gap")
            return
        role.handle(msg)

    # -- roles -----------------------------------------------------------------------------

    def _on_view(self, view: GroupView) -> None:
        with self._lock:
            if self._closed:
                return
            rank = self.cfg.pp_rank
            leader = view.leader
            role = self._role
            if leader is not None and leader.pp_rank != self._leader_rank:
                if self._leader_rank is not None and self._metrics is not None:
                    self._metrics.leader_changes.labels(group=self.cfg.group).inc()
                self._leader_rank = leader.pp_rank
            if self._metrics is not None:
                self._metrics.pp_epoch.labels(group=self.cfg.group).set(view.epoch)
            followers = {m.pp_rank: m.fanout_endpoint for m in view.followers()}
            if isinstance(role, LeaderRole) and leader is not None and \
                    leader.pp_rank == rank and role.epoch == view.epoch:
                role.stream.set_followers(followers)
                return
            if isinstance(role, FollowerRole) and leader is not None and \
                    leader.pp_rank != rank and role.epoch == view.epoch:
                # Same epoch: a leader restarted at a new address resyncs at once.
                role.follow_endpoint(leader.fanout_endpoint)
                return
            self._end_role()
            if leader is None:
                log.warning("Group has no leader; calls answer not stored / miss",
                            extra={"group": self.cfg.group, "epoch": view.epoch})
                return
            try:
                if leader.pp_rank == rank:
                    self._role = self._make_leader(view.epoch, followers)
                else:
                    follower = self._make_follower(view.epoch, leader.fanout_endpoint)
                    self._role = follower
                    follower.start()
            except Exception:
                log.exception("Cannot take the group role", extra={"group": self.cfg.group,
                                                                    "epoch": view.epoch})
                self._role = None
                return
            if self._metrics is not None:
                self._metrics.set_role(self.cfg.group, self._role.role)
            log.info("Took group role", extra={"group": self.cfg.group, "role": self._role.role,
                                                "epoch": view.epoch, "rank": rank})

    def _make_leader(self, epoch: int, followers: dict[int, str]) -> LeaderRole:
        if self._store is not None:
            # A promoted follower: its store's tiers would double this stage's
            # memory next to the leader backend's own.
            _close_store(self._store)
            self._store = None
        backend = self._backend_factory()
        for r, bufs in self._buffers.items():
            backend.register_kv_buffers(r, bufs)
        backend.start()
        return LeaderRole(self.cfg, epoch, backend, followers, self._keys, self._stats,
                          self._num_slots, self._notify_completed, self._cache_epoch)

    def _make_follower(self, epoch: int, leader_endpoint: str) -> FollowerRole:
        if self._store is None:
            store = self._store_factory()
            for r, bufs in self._buffers.items():
                _registrable(store).register_kv_buffers(r, bufs)
            self._store = store
        return FollowerRole(self.cfg, epoch, leader_endpoint, self._store, self._keys,
                            self._stats, self._num_slots, self._notify_completed,
                            self._cache_epoch)

    def _end_role(self) -> None:
        role, self._role = self._role, None
        if role is not None:
            role.close()
            # close() waited for the role's copies: its queued rids and its
            # in-flight stores no longer read the engine's source slots, and no
            # later role will report them.
            self._completed.add(role.take_unreported())
        # A follower store is kept across follower epochs until the connector closes.
        if self._closed and self._store is not None:
            _close_store(self._store)
            self._store = None

    # -- registration ----------------------------------------------------------------------

    def register_kv_buffers(self, rank: int, buffers: Sequence[Sequence[torch.Tensor]]) -> None:
        """Register engine rank ``rank``'s KV buffers with this stage (every role).

        Validated against the layout first (``ValueError`` naming the bad
        value, nothing registered).
        """
        reg = register_buffers(self.cfg.layout, rank, buffers)
        with self._lock:
            role = self._role
            if isinstance(role, LeaderRole):
                role.backend.register_kv_buffers(rank, buffers)
            if self._store is not None:
                store = _registrable(self._store)
                if isinstance(role, FollowerRole):
                    role.swap_buffers(lambda: store.register_kv_buffers(rank, buffers))
                else:
                    store.register_kv_buffers(rank, buffers)
            self._buffers[rank] = buffers
            # A re-registration (an engine restarted with other buffers) replaces
            # the rank's size: the limit is the smallest of the current buffers.
            self._slots_by_rank[rank] = reg.num_slots
            slots = min(self._slots_by_rank.values())
            self._num_slots = slots
            if role is not None:
                role.num_slots = slots

    # -- engine calls ----------------------------------------------------------------------

    def store_kv(
        self,
        rid: str,
        token_ids: Sequence[int] | npt.NDArray[np.integer],
        kv_indices: torch.Tensor | npt.NDArray[np.integer],
    ) -> int:
        """Store the KV of ``token_ids`` from slots ``kv_indices`` (parallel arrays).

        Raises ``ValueError`` when the lengths differ ("store_kv: token_ids has N
        entries but kv_indices has M entries") or an input is invalid, with
        nothing decided or written: a rejected call leaves the fan-out stream as
        if it had not been made; so are slots that are not whole, aligned pages of a
        paged layout (``ValueError`` naming the page size, the position and the
        slot). Aligns down to whole pages; returns the task id of
        the group store, or -1 when nothing is stored (nothing new, aligned
        length 0, a degraded group, a timeout, a failure on this stage).
        ``poll_completed`` later reports ``rid`` once every stage is terminal.
        """
        inp = prepare_store(token_ids, kv_indices, self.cfg.tokens_per_block, self._num_slots,
                            self.cfg.whole_pages)
        role = self._role
        if role is None:
            return -1
        return role.store_kv(rid, inp)

    def lookup(
        self,
        rid: str,
        token_ids: Sequence[int] | npt.NDArray[np.integer],
        token_mask: npt.NDArray[np.bool_] | None = None,
    ) -> int:
        """Tokens of ``token_ids`` every stage can load (a block-aligned prefix
        span); 0 on a miss, a timeout or a degraded group. A later lookup for
        the same rid cancels this one. ``token_mask`` (optional): one bool per
        token, True over one span starting at a block boundary; anything else
        raises ``ValueError`` naming it, before any decision."""
        inp = prepare_lookup(token_ids, token_mask, self.cfg.tokens_per_block)
        role = self._role
        with self._lock:
            self._claim_ended(rid)  # the role's lookup ends the claim
            self._lookups[rid] = role
            self._lookups.move_to_end(rid)
            while len(self._lookups) > self.cfg.max_pending:
                self._lookups.popitem(last=False)
        if role is None:
            return 0
        return role.lookup(rid, inp)

    def retrieve(self, rid: str, slot_mapping: torch.Tensor | npt.NDArray[np.integer]) -> int:
        """Load the span found by ``lookup(rid)`` into ``slot_mapping`` (one slot
        per hit token). Returns the tokens loaded: the hit when every stage
        loaded its layers, else 0 (treat the slots as garbage); 0 as well when
        the role that answered the lookup ended since (a new epoch or leader).
        Raises ``ValueError`` for a bad slot mapping (with a paged layout, also
        slots that are not whole, aligned pages), before anything is loaded; its
        lookup ends as a miss.
        Raises ``UnknownRequestError`` when ``rid`` has no open lookup.
        Raises :class:`SlotsStillWrittenError` when this stage's load copy did not
        stop after its timeout and abort (a hung device): it may still write
        ``slot_mapping``'s slots, which the engine must keep out of use (every
        other stage answers a miss)."""
        role = self._role
        with self._lock:
            asked = self._lookups.pop(rid, _ABSENT)
        if asked is not _ABSENT and (asked is None or asked is not role):
            return 0  # its lookup's decision died with the old role: a miss
        if role is None:
            raise UnknownRequestError(rid, "retrieve", "the group has no leader right now")
        return role.retrieve(rid, slot_mapping)

    def claim_load(self, rid: str) -> tuple[int, list[int], dict[str, Any], int] | None:
        """Hand the span found by ``lookup(rid)`` to the engine to copy itself from
        the shared CPU tier: ``(hit tokens, the tier block of each hit block in
        token order, the tier's handle, the claim's id)``; the blocks stay pinned
        until :meth:`commit_load` of that id (or ``transfer_seconds``). ``(0, [],
        {}, -1)`` for a miss,
        also when the role that answered the lookup ended since. None when this
        stage cannot hand it out (followers, tensor parallelism, a backend without
        a shared tier, a block not on the CPU tier): call :meth:`retrieve`.
        Raises ``UnknownRequestError`` when ``rid`` has no open lookup."""
        role = self._role
        with self._lock:
            asked = self._lookups.get(rid, _ABSENT)
        if asked is not _ABSENT and (asked is None or asked is not role):
            with self._lock:
                self._lookups.pop(rid, None)
            return 0, [], {}, -1
        if role is None:
            raise UnknownRequestError(rid, "claim_load", "the group has no leader right now")
        handle = _tier_of(role, self.cfg.expected_ranks)
        if handle is None or not isinstance(role, LeaderRole):
            return None
        got = role.claim_load(rid)
        if got is None:
            return None
        claim = -1
        with self._lock:
            self._lookups.pop(rid, None)
            if got[1]:
                claim = next(self._claim_ids)
                self._ended.pop(rid, None)
                self._claims[rid] = (role, got[2], claim)
                self._claims.move_to_end(rid)
                while len(self._claims) > self.cfg.max_pending:
                    self._claims.popitem(last=False)
        return got[0], got[1], handle if got[1] else {}, claim

    def tier_handle(self) -> dict[str, Any] | None:
        """The shared CPU tier this stage hands loads out of (:meth:`claim_load`), for
        an engine to map ahead of its first claim; None when it hands none out."""
        return _tier_of(self._role, self.cfg.expected_ranks)

    def claim_fence(self, rid: str, claim: int) -> int | None:
        """The claim fence recorded when ``rid``'s live claim ``claim`` (the id
        :meth:`claim_load` answered) was made, from the backend of the role that made
        it; None when that is not ``rid``'s live claim any more or the tier has no
        fence (see :meth:`ReplicatedBackend.claim_fence`)."""
        with self._lock:
            live = self._claims.get(rid)
        if live is None or live[2] != claim:
            return None
        return live[0].backend.claim_fence(live[1])

    def commit_load(self, rid: str, claim: int) -> bool:
        """The engine's copy of ``rid``'s claimed load ended: True when the blocks
        it read stayed pinned throughout (the slots hold the cached KV); False when
        the claim ended first or its role did (a miss: the slots hold undefined
        data), also when a ``release`` or a new ``lookup`` of ``rid`` came first,
        or when ``claim`` is not the id of ``rid``'s live claim (an older one).
        Raises ``UnknownRequestError`` when ``rid`` has no claim (never claimed,
        already committed, or forgotten: more than ``max_pending`` claims)."""
        with self._lock:
            live = self._claims.get(rid)
            if live is not None and live[2] != claim:
                return False  # an older claim of the rid: the live one stays
            if live is not None:
                del self._claims[rid]
            ended = self._ended.pop(rid, _ABSENT) is not _ABSENT
        if live is None:
            if ended:
                return False  # a release or new lookup ended it
            raise UnknownRequestError(rid, "commit_load", "call claim_load first")
        claimer = live[0]
        if claimer is not self._role:
            return False  # its backend ended with its role
        return claimer.commit_load(rid, live[1])

    def _claim_ended(self, rid: str) -> None:
        """``rid``'s claim (if any) was ended by a release or lookup: its commit
        answers False once. Under ``_lock``."""
        if self._claims.pop(rid, None) is not None:
            self._ended[rid] = None
            while len(self._ended) > self.cfg.max_pending:
                self._ended.popitem(last=False)

    def release(self, rid: str) -> None:
        """The engine is done with ``rid``: ends everything of it on this stage
        (an un-used lookup, decisions no call took); a reused rid starts clean."""
        with self._lock:
            self._lookups.pop(rid, None)
            self._claim_ended(rid)  # the role's release ends the claim
        role = self._role
        if role is not None:
            role.release(rid)

    def poll_completed(self) -> list[str]:
        """Rids whose store is terminal on every stage; the engine may free their
        source slots only now. Rids of a role that ended (a new epoch or
        leader) are reported too: its close waited for their copies."""
        out = self._completed.drain()
        role = self._role
        if role is not None:
            out += role.poll_completed()
        return out

    def wait_completed(self, timeout: float) -> list[str]:
        """Like :meth:`poll_completed`, but waits up to ``timeout`` seconds for a rid
        to become reportable (``[]`` then): the roles notify a condition when they
        queue one, so the caller wakes at once, without polling."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._done:
            # Drained under the condition: a rid queued after the drain notifies
            # only once this thread waits (the notifier needs the lock), so no
            # wake-up is lost.
            while True:
                out = self.poll_completed()
                remaining = deadline - time.monotonic()
                if out or remaining <= 0:
                    return out
                self._done.wait(remaining)

    def _notify_completed(self) -> None:
        with self._done:
            self._done.notify_all()
        hook = self._completion_hook
        if hook is not None:
            hook()

    def set_completion_hook(self, hook: Callable[[], None] | None) -> None:
        """Call ``hook()`` (no lock held, from the thread that queued it) whenever
        a rid becomes reportable by :meth:`poll_completed`, besides waking
        :meth:`wait_completed`: the engine socket's notice to answer a parked
        ``wait_completed``. It must be cheap and must not block."""
        self._completion_hook = hook

    def reset(self) -> None:
        """Flush: the leader flushes the whole group; a follower its pending state."""
        role = self._role
        if role is not None:
            role.reset()

    # -- health ----------------------------------------------------------------------------

    def tier_bytes(self) -> dict[str, tuple[int, int]] | None:
        """Tier name -> (capacity, used) bytes, from the leader backend's own stats;
        None while this stage is not the leader (a follower's store keeps no index)."""
        role = self._role
        if not isinstance(role, LeaderRole):
            return None
        return {name: (t.capacity_bytes, t.used_bytes)
                for name, t in role.backend.stats().tiers.items()}

    def recovered_blocks(self) -> int | None:
        """SSD blocks the leader backend recovered at its start (a persistent SSD
        tier); None while this stage is not the leader."""
        role = self._role
        if not isinstance(role, LeaderRole):
            return None
        ssd = role.backend.stats().tiers.get("ssd")
        return ssd.recovered_blocks if ssd is not None else 0

    def lookup_totals(self) -> tuple[int, int, int] | None:
        """(source, tokens looked up, tokens hit) since the leader backend started,
        from its own stats; ``source`` names that backend instance (another backend,
        after a role change, counts from zero). None while this stage is not the
        leader or when its backend does not count lookups."""
        role = self._role
        if not isinstance(role, LeaderRole):
            return None
        stats = role.backend.stats()
        if stats.lookup_tokens is None:
            return None
        hit_blocks = sum(t.hit_blocks for t in stats.tiers.values())
        return id(role.backend), stats.lookup_tokens, hit_blocks * self.cfg.tokens_per_block

    def peek(self, tokens: npt.NDArray[np.int64]) -> dict[str, int] | None:
        """The leader backend's read-only :meth:`ReplicatedBackend.peek` of
        ``tokens``; None while this stage is not the leader or when its backend
        cannot peek."""
        role = self._role
        if not isinstance(role, LeaderRole):
            return None
        return role.backend.peek(tokens)

    def ready(self) -> bool:
        """True when started, every expected engine rank registered, this stage
        holds a role and is not degraded (for /readyz)."""
        role = self._role
        return (
            self._started and not self._closed and role is not None
            and len(self._buffers) >= self.cfg.expected_ranks and not role.degraded()
        )

    def status(self) -> dict[str, Any]:
        """Role, group, epoch, last seq, peers, degraded flag, counters, drops."""
        role = self._role
        view = self._view.view
        out: dict[str, Any] = {
            "group": self.cfg.group,
            "ppRank": self.cfg.pp_rank,
            "role": None,
            "epoch": view.epoch,
            "leaderRank": None if view.leader is None else view.leader.pp_rank,
            "lastSeq": -1,
            "peersConnected": 0,
            "degraded": True,
            "registeredRanks": sorted(self._buffers),
            "fanoutEndpoint": self.fanout_endpoint,
            "dropped": dict(self._stats.dropped),
            "cacheEpochRefused": dict(self._stats.epoch_refused),
        }
        if role is not None:
            out.update(role.status())
        out["ready"] = self.ready()
        return out


def _tier_of(role: Role | None, expected_ranks: int) -> dict[str, Any] | None:
    """The shared CPU tier ``role`` hands loads out of: a leader without followers,
    of a stage of one TP rank, whose backend has one."""
    if not isinstance(role, LeaderRole) or expected_ranks != 1 or role.expected_followers():
        return None
    return role.backend.tier_handle()


def _registrable(store: StageStore) -> RegistrableStore:
    if not hasattr(store, "register_kv_buffers"):
        raise TypeError(
            f"{type(store).__name__} has no register_kv_buffers; the store factory must "
            "return a stage store engine ranks can register with (e.g. TierStore)"
        )
    return store


def _close_store(store: StageStore) -> None:
    close = getattr(store, "close", None)
    if callable(close):
        close()

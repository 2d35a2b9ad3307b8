"""The group leader's side of the coordinator: it alone owns the index and decides.

Every decision is taken under one *decision lock* that also covers its
broadcast, so the stream order is the decision order (a move that frees a
block always precedes a plan that reuses it). The leader answers every engine
call of the followers: manager errors become error decisions, never silence.

Puts: ``put_match`` -> moves -> PUT decision (before launching) -> launch. A
reaper thread finishes each put once it is terminal locally and every
follower acked (or the deadline passed): publish when all succeeded, else
discard; then it broadcasts the RESULT and reports the rid in
``poll_completed``.

Gets: ``prefetch`` (outside the decision lock: blocks only the remote tier holds
are fetched into the cache, so a long fetch never stalls other requests'
decisions) -> ``get_match`` -> moves -> GET decision. ``retrieve`` first collects the
followers' load acks while its own task is still un-launched (the matched
blocks stay locked, so no later decision can reuse them under a follower's
load), then loads locally and broadcasts the group verdict.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from node_agent.backend.base import KVResponseStatus
from node_agent.backend.replication import ReplicatedBackend
from node_agent.coordinator.config import CoordinatorConfig
from node_agent.coordinator.errors import SlotsStillWrittenError, UnknownRequestError
from node_agent.coordinator.inputs import LookupInput, StoreInput, prepare_slots
from node_agent.coordinator.tracking import AckCollector, CompletedRids, DecisionNumbers, RidLives
from node_agent.pp.auth import CurveKeys
from node_agent.pp.messages import (
    NO_CACHE_EPOCH,
    Ack,
    Cancel,
    Decision,
    Kind,
    Message,
    Moves,
    Op,
    Release,
    Reset,
    Result,
)
from node_agent.pp.stream import LeaderStream, StreamMetrics
from node_agent.vocab.placement import Direction, TierMove, TransferPlan

log = logging.getLogger(__name__)

STOP_WAIT_SECONDS = 2.0
"""How long a timed-out copy gets to end after its cancel before the leader gives up
(at most; never longer than the copy's own wait, ``LeaderRole._end_copy``)."""
VERDICT_MARGIN_FRACTION = 0.1
VERDICT_MARGIN_SECONDS = 0.05
"""The part of a follower's verdict wait a leader's ok verdict leaves for the
messages' transit (``_verdict_late``): a tenth, at least 50 ms."""
_RUNNING = (KVResponseStatus.TIMEOUT, KVResponseStatus.UNREADY)


@dataclass
class _Put:
    rid: str
    n: int
    task_id: int
    acks: AckCollector
    deadline: float
    local: KVResponseStatus | None = None
    error: str | None = None


@dataclass
class _Get:
    n: int
    task_id: int
    hit: int
    acks: AckCollector
    used: bool = False
    claimed: bool = False
    """The engine copies this get itself (:meth:`LeaderRole.claim_load`)."""


@dataclass
class LeaderCounters:
    """Totals reported in ``status()``."""

    stores: int = 0
    stores_published: int = 0
    stores_discarded: int = 0
    lookups: int = 0
    hit_tokens: int = 0
    retrieves: int = 0
    retrieve_misses: int = 0
    claimed_loads: int = 0
    """Loads the engine copied itself (``claim_load``)."""
    claims_expired: int = 0
    """Claimed loads whose claim ended before the engine committed (a miss)."""
    manager_errors: int = 0
    degraded_refusals: int = 0
    cache_epoch_refusals: int = 0
    stepped_down_refusals: int = 0
    loads_still_writing: int = 0
    """Retrieves answered ``SlotsInUse``: their load copy did not stop."""
    late_verdict_misses: int = 0
    """Retrieves answered a miss because a follower may have stopped waiting
    for their verdict (``LeaderRole._verdict_late``)."""
    flushes: int = 0
    moves_sent: int = 0


class LeaderRole:
    """Leader of one group for one epoch (see module docstring)."""

    role = "leader"

    def __init__(
        self,
        cfg: CoordinatorConfig,
        epoch: int,
        backend: ReplicatedBackend,
        followers: dict[int, str],
        keys: CurveKeys | None,
        stats: StreamMetrics,
        num_slots: int | None,
        on_completed: Callable[[], None] | None = None,
        cache_epoch: Callable[[], int] | None = None,
    ) -> None:
        """``on_completed()``: called whenever rids become reportable by
        :meth:`poll_completed` (the connector's completion notification).
        ``cache_epoch()``: this agent's current ``cacheEpoch`` (the remote tier's
        key epoch; switched before the flush that applies it)."""
        self.cfg = cfg
        self.epoch = epoch
        self.backend = backend
        self.num_slots = num_slots
        self.counters = LeaderCounters()
        self._decide = threading.Lock()
        self._state = threading.Lock()
        self._puts: dict[int, _Put] = {}
        self._gets: OrderedDict[str, _Get] = OrderedDict()
        self._claimed: OrderedDict[str, _Get] = OrderedDict()
        """Gets an engine copies itself, from ``claim_load`` to ``commit_load``: out of
        ``_gets``, so no later lookup's bound drops their record before the commit."""
        self._completed = CompletedRids(cfg.max_completed, stats.completed_dropped,
                                        on_completed)
        self._calls = DecisionNumbers()
        self._lives = RidLives()
        self._cache_epoch = cache_epoch or (lambda: 0)
        self._content_epoch = self._cache_epoch()
        """The cache epoch the group cache holds blocks of (set by each flush)."""
        self._wake = threading.Event()
        self._reaping = threading.Lock()
        """Held by whoever reaps puts (the reaper, or a finished copy's thread)."""
        # A copy that ends finishes its put at once when it can (the reaper
        # looks every few ms otherwise).
        backend.set_completion_listener(self._on_copy_done)
        # Remote fetches run in lookup() before the decision lock is taken, so one
        # request's long fetch never holds up the other requests' decisions.
        backend.fetch_in_match = False
        self._stop = threading.Event()
        self._stats = stats
        self.newer_epoch: int | None = None
        """Set once a newer epoch was seen: this leader no longer decides."""
        self.stream = LeaderStream(cfg.group, epoch, keys, stats, self._flush, self._on_ack,
                                   heartbeat_interval=cfg.heartbeat_seconds,
                                   on_newer_epoch=self.step_down)
        self.stream.set_followers(followers)
        self._reaper = threading.Thread(target=self._reap_loop, name=f"reaper-{cfg.group}",
                                        daemon=True)
        self._reaper.start()

    # -- helpers -------------------------------------------------------------------------

    def _expected(self) -> frozenset[int]:
        return frozenset(self.stream.follower_ranks)

    def _decision(self, kind: Kind, rid: str, n: int, task_id: int,
                  mask: npt.NDArray[np.bool_], plan: TransferPlan | None, digest: int,
                  error: str | None = None, cache_epoch: int = 0) -> Decision:
        """A decision in the rid's current life (call under the decision lock)."""
        direction = Direction.STORE if kind is Kind.PUT else Direction.LOAD
        return Decision.build(direction, rid, n, task_id, mask, plan, error, digest,
                              self._lives.life(rid), cache_epoch)

    def _refuse(self, kind: Kind, rid: str, n: int, length: int, digest: int,
                error: str) -> None:
        """Broadcast an error decision (task -1) so followers answer at once."""
        op = Op.PUT if kind is Kind.PUT else Op.GET
        epoch = self._content_epoch
        self.stream.broadcast(op, lambda: self._decision(kind, rid, n, -1,
                                                         np.zeros(length, bool), None, digest,
                                                         error, epoch))

    def _send_moves(self, moves: list[TierMove], cache_epoch: int) -> None:
        """Broadcast tier moves decided under ``cache_epoch`` (decision lock held)."""
        if moves:
            self.counters.moves_sent += len(moves)
            self.stream.broadcast(Op.MOVES, Moves(tuple(moves), cache_epoch))

    def _switched(self, kind: Kind, epoch: int) -> str | None:
        """Why a decision that started under cache epoch ``epoch`` cannot stand
        (None when it can): the agent's ``cacheEpoch`` moved meanwhile, so the
        match may have used either epoch's remote keys. Counts the refusal."""
        now = self._cache_epoch()
        if now == epoch:
            return None
        self.counters.cache_epoch_refusals += 1
        self._stats.cache_epoch_refused(kind.value)
        return (f"cacheEpoch moved from {epoch} to {now} while the leader decided; the "
                "group cache is flushed for the new epoch next")

    def _refusal(self, kind: Kind, epoch: int) -> str | None:
        """Why this leader cannot decide now under cache epoch ``epoch`` (None
        when it can); counts the refusal."""
        if epoch != self._content_epoch:
            # Between the key switch and the flush: the cache still holds blocks of
            # the old epoch, and a fetch would read the new one's keys.
            self.counters.cache_epoch_refusals += 1
            self._stats.cache_epoch_refused(kind.value)
            return (f"cacheEpoch {epoch} applies on this agent but the group cache still "
                    f"holds blocks of epoch {self._content_epoch} until its flush")
        if self.newer_epoch is not None:
            self.counters.stepped_down_refusals += 1
            return (f"leader of epoch {self.epoch} stepped down: epoch {self.newer_epoch} "
                    "exists")
        missing = self.stream.unsynced_ranks()
        if not missing:
            return None
        self.counters.degraded_refusals += 1
        return f"group degraded: followers {missing} are not synced with the leader"

    def _match_in_epoch(
        self, kind: Kind, rid: str, n: int, length: int, digest: int, epoch: int,
        match: Callable[[], tuple[int, npt.NDArray[np.bool_]]],
    ) -> tuple[int, npt.NDArray[np.bool_], TransferPlan | None] | None:
        """The backend's ``match`` for call ``n`` under cache epoch ``epoch`` (call
        under the decision lock): ``(task_id, mask, plan)``, its tier moves sent to
        the followers. ``None`` when the call is refused instead (the group cannot
        decide, the match failed, or the cache epoch switched meanwhile): the
        refusal is fanned out and a matched task cancelled."""
        refusal = self._refusal(kind, epoch)
        if refusal is not None:
            self._refuse(kind, rid, n, length, digest, refusal)
            return None
        op = "put_match" if kind is Kind.PUT else "get_match"
        task_id = -1
        try:
            task_id, mask = match()
            plan = self.backend.plan_of(task_id) if task_id >= 0 else None
            moves = self.backend.drain_moves()
        except Exception as exc:
            self.counters.manager_errors += 1
            log.exception("Leader %s failed", op, extra={"group": self.cfg.group, "rid": rid})
            if task_id >= 0:
                self.backend.cancel([task_id])
            self._refuse(kind, rid, n, length, digest, f"leader {op} failed: {exc}")
            return None
        switched = self._switched(kind, epoch)
        self._send_moves(moves, NO_CACHE_EPOCH if switched else epoch)
        if switched is not None:
            if task_id >= 0:
                self.backend.cancel([task_id])
            self._refuse(kind, rid, n, length, digest, switched)
            return None
        return task_id, mask, plan

    # -- store -----------------------------------------------------------------------------

    def store_kv(self, rid: str, inp: StoreInput) -> int:
        """Decide, fan out, then launch; returns the task id or -1."""
        self.counters.stores += 1
        if inp.aligned == 0:
            return -1  # every stage answers -1 without a decision
        n = self._calls.next()
        with self._decide:
            epoch = self._cache_epoch()
            matched = self._match_in_epoch(Kind.PUT, rid, n, inp.aligned, inp.digest, epoch,
                                           lambda: self.backend.put_match(inp.tokens))
            if matched is None:
                return -1
            task_id, mask, plan = matched
            if task_id < 0:
                self.stream.broadcast(Op.PUT, lambda: self._decision(Kind.PUT, rid, n, -1, mask,
                                                                     None, inp.digest,
                                                                     cache_epoch=epoch))
                return -1
            deadline = time.monotonic() + self.cfg.engine_call_seconds
            track = _Put(rid, n, task_id, AckCollector(self._expected()), deadline)
            with self._state:
                self._puts[task_id] = track
            self.stream.broadcast(Op.PUT, lambda: self._decision(Kind.PUT, rid, n, task_id, mask,
                                                                 plan, inp.digest,
                                                                 cache_epoch=epoch))
        try:
            self.backend.launch([task_id], [inp.slots.select(mask)])
        except Exception as exc:
            self.counters.manager_errors += 1
            log.warning("Leader launch failed, the store will be discarded",
                        extra={"group": self.cfg.group, "rid": rid, "error": str(exc)})
            self.backend.cancel([task_id])
            track.local, track.error = KVResponseStatus.FAILED, str(exc)
            self._wake.set()
            return -1
        self._wake.set()
        return task_id

    def poll_completed(self) -> list[str]:
        """Rids whose store is terminal on every stage (source slots may be freed)."""
        return self._completed.drain()

    def _on_ack(self, ack: Ack) -> None:
        with self._state:
            if ack.kind is Kind.PUT:
                t = self._puts.get(ack.task_id)
                if t is not None and (t.rid, t.n) == (ack.rid, ack.n):
                    t.acks.add(ack)
                    self._wake.set()
            else:
                g = self._gets.get(ack.rid)
                if g is not None and (g.n, g.task_id) == (ack.n, ack.task_id):
                    g.acks.add(ack)

    def _reap_loop(self) -> None:
        while not self._stop.is_set():
            # Cleared before looking, so a wake-up (a finished copy, an ack) that
            # arrives while this step runs makes the next wait return at once.
            self._wake.clear()
            with self._state:
                pending = list(self._puts.values())
            if not pending:
                self._wake.wait(0.05)
                continue
            try:
                with self._reaping:
                    self._reap(pending)
            except Exception:  # keep finishing the other puts; the deadline still holds
                log.exception("Leader reaper step failed", extra={"group": self.cfg.group})
            self._wake.wait(0.002)

    def _on_copy_done(self) -> None:
        """A copy of this leader's backend ended (on the thread that ran it):
        finish at once every put whose copy is terminal and whose followers all
        acked (a single-stage group's put has no follower to wait for), saving
        the hop to the reaper. Never blocks: when the reaper or a decision holds
        what this needs (a flush waits for this very thread while holding the
        decision lock), the woken reaper finishes the put instead."""
        self._wake.set()
        if self.newer_epoch is not None or not self._reaping.acquire(blocking=False):
            return
        try:
            with self._state:
                ready = [t for t in self._puts.values() if t.acks.done()]
            live = [t.task_id for t in ready if t.local is None]
            if live:
                for tid, resp in self.backend.try_wait(live).items():
                    t = next(p for p in ready if p.task_id == tid)
                    t.local, t.error = resp.status, resp.error
            for t in ready:
                if t.local is not None and self.newer_epoch is None:
                    self._finish_put(t, t.local is KVResponseStatus.SUCCESS
                                     and t.acks.all_ok(), wait=False)
        except Exception:  # the reaper finishes what this could not
            log.exception("Finishing a put after its copy failed",
                          extra={"group": self.cfg.group})
        finally:
            self._reaping.release()

    def _reap(self, pending: list[_Put]) -> None:
        live = [t.task_id for t in pending if t.local is None]
        if live:
            try:
                for tid, resp in self.backend.try_wait(live).items():
                    t = next(p for p in pending if p.task_id == tid)
                    t.local, t.error = resp.status, resp.error
            except Exception as exc:
                log.warning("Leader try_wait failed",
                            extra={"group": self.cfg.group, "error": str(exc)})
        now = time.monotonic()
        stepped_down = self.newer_epoch is not None
        for t in pending:
            if t.local is not None and t.acks.done() and not stepped_down:
                self._finish_put(t, t.local is KVResponseStatus.SUCCESS and t.acks.all_ok())
            elif stepped_down or now > t.deadline:
                if t.local is None:
                    # Bounded: the copy may still be running; let it end first.
                    t.local = self._end_copy(t.rid, t.task_id, self.cfg.transfer_seconds)
                    if t.local is None:
                        continue  # still reading source slots: not completed yet
                log.warning("Store discarded: the leader stepped down" if stepped_down else
                            "Store not acked by every follower in time, discarding",
                            extra={"group": self.cfg.group, "rid": t.rid,
                                   "missing": t.acks.missing()})
                self._finish_put(t, False)

    def _end_copy(self, rid: str, task_id: int, timeout: float) -> KVResponseStatus | None:
        """Wait up to ``timeout`` for the launched ``task_id``; when it is still
        running, cancel it and wait up to ``timeout`` more (at most
        :data:`STOP_WAIT_SECONDS`): a retrieve's chain of waits (acks, copy, stop)
        then stays within the call budget (``fanout + 3 x transfer``), so its
        engine is answered before the server's last resort, also when the copy
        did not stop.

        Returns the terminal status, or None when the copy may still touch the
        engine's slots (the caller must not answer the engine / report the rid
        as if it were done).
        """
        last = self.backend.wait([task_id], timeout=timeout, completely=True).get(task_id)
        if last is not None and last.status not in _RUNNING:
            return last.status
        self.backend.cancel([task_id])
        stop_wait = min(STOP_WAIT_SECONDS, timeout)
        last = self.backend.wait([task_id], timeout=stop_wait,
                                 completely=True).get(task_id)
        if last is not None and last.status not in _RUNNING:
            return last.status
        log.error("A copy did not end after its cancel",
                  extra={"group": self.cfg.group, "rid": rid, "task_id": task_id,
                         "waited_seconds": timeout + stop_wait})
        return None

    def _finish_put(self, t: _Put, ok: bool, wait: bool = True) -> None:
        """Publish (``ok``) or discard put ``t``, broadcast its RESULT and report
        its rid. With ``wait=False`` nothing happens when the decision lock is
        taken (the reaper finishes the put later)."""
        if not self._decide.acquire(blocking=wait):
            return
        try:
            with self._state:
                if t.task_id not in self._puts:
                    return  # a flush or another finisher already ended it
            if ok:
                try:
                    self.backend.publish(t.task_id)
                except Exception as exc:
                    log.warning("Leader publish failed, discarding",
                                extra={"group": self.cfg.group, "rid": t.rid, "error": str(exc)})
                    ok = False
            if not ok:
                self.backend.discard(t.task_id)
            # A publish may decide moves (a remote tier's CPU -> REMOTE writes): the
            # followers get them now rather than with the next decision.
            moves = self.backend.drain_moves()
            if moves:
                epoch = self._cache_epoch()
                self._send_moves(moves, epoch if epoch == self._content_epoch
                                 else NO_CACHE_EPOCH)
            self.stream.broadcast(Op.RESULT, Result(t.rid, Kind.PUT, t.n, t.task_id, ok))
            # One step under the state lock: status() never shows the put gone
            # from the in-flight stores but not yet counted, and take_unreported
            # (a close while a copy's thread finishes this put) finds its rid in
            # the in-flight stores or in the reportable rids, never in neither.
            with self._state:
                if self._puts.pop(t.task_id, None) is None:
                    return  # take_unreported (after close) reported it
                if ok:
                    self.counters.stores_published += 1
                else:
                    self.counters.stores_discarded += 1
                self._completed.add([t.rid])
        finally:
            self._decide.release()

    # -- load ------------------------------------------------------------------------------

    def lookup(self, rid: str, inp: LookupInput) -> int:
        """Match, fan the decision out, return the hit tokens (0 on any failure)."""
        tokens, token_mask = inp.tokens, inp.mask
        n = self._calls.next()
        self.counters.lookups += 1
        self._cancel_get(rid)
        if self.newer_epoch is None and self._cache_epoch() == self._content_epoch:
            # Never between a key switch and the flush: the fetch would continue an
            # old-epoch local prefix with the new epoch's objects.
            self._prefetch(rid, inp)
        with self._decide:
            epoch = self._cache_epoch()
            matched = self._match_in_epoch(Kind.GET, rid, n, len(tokens), inp.digest, epoch,
                                           lambda: self.backend.get_match(tokens, token_mask))
            if matched is None:
                self._remember_miss(rid, n)
                return 0
            task_id, mask, plan = matched
            hit = int(np.count_nonzero(mask)) if task_id >= 0 else 0
            with self._state:
                self._gets[rid] = _Get(n, task_id, hit, AckCollector(self._expected()))
                stale = []
                while len(self._gets) > self.cfg.max_pending:
                    stale.append(self._gets.popitem(last=False))
            # Built only when a follower will receive it (plan runs and encoding
            # are most of a decision's cost; a single-stage group has no follower).
            self.stream.broadcast(Op.GET, lambda: self._decision(Kind.GET, rid, n, task_id, mask,
                                                                 plan, inp.digest,
                                                                 cache_epoch=epoch))
            for old_rid, g in stale:  # lookups never retrieved nor released
                if g.task_id >= 0 and not g.used:
                    self.backend.cancel([g.task_id])
                    self.stream.broadcast(Op.CANCEL, Cancel(old_rid, Kind.GET, g.n, g.task_id))
        self.counters.hit_tokens += hit
        return hit

    def _prefetch(self, rid: str, inp: LookupInput) -> None:
        """Fetch the prompt's blocks that only the remote tier holds, outside the
        decision lock (the backend reserves them, fetches, then publishes the run
        that arrived and queues its moves for the next decision). A failure is a
        shorter hit, never an error of the lookup."""
        try:
            self.backend.prefetch(inp.tokens, inp.mask)
        except Exception:
            log.exception("Leader prefetch failed", extra={"group": self.cfg.group, "rid": rid})

    def _remember_miss(self, rid: str, n: int) -> None:
        """A lookup that answered 0 without a task: its retrieve answers 0."""
        with self._state:
            self._gets[rid] = _Get(n, -1, 0, AckCollector(frozenset()))
            while len(self._gets) > self.cfg.max_pending:
                self._gets.popitem(last=False)

    def _cancel_get(self, rid: str) -> None:
        """Cancel ``rid``'s un-used load task (a second lookup, or a release); a
        claimed one the engine did not commit ends its claim (a later commit
        answers False)."""
        with self._state:
            g = self._gets.pop(rid, None)
            claimed = self._claimed.pop(rid, None)
        if claimed is not None:
            self.backend.end_claim(claimed.task_id, committed=False)
        if g is not None and g.task_id >= 0 and not g.used:
            with self._decide:
                self.backend.cancel([g.task_id])
                self.stream.broadcast(Op.CANCEL, Cancel(rid, Kind.GET, g.n, g.task_id))

    def _open_get(self, rid: str, op: str) -> _Get:
        """``rid``'s open lookup, now taken by ``op`` (a lookup that missed is
        forgotten: its answer is a miss, like every follower's). Raises
        ``UnknownRequestError`` when there is none or it was already taken."""
        with self._state:
            g = self._gets.get(rid)
            if g is None:
                raise UnknownRequestError(rid, op, "call lookup first")
            if g.used:
                raise UnknownRequestError(rid, op, "its lookup was already retrieved or "
                                          "claimed; call lookup again")
            g.used = True
            if g.task_id < 0:
                del self._gets[rid]
        return g

    def retrieve(self, rid: str, slot_mapping: object) -> int:
        """Load the looked-up span into ``slot_mapping`` on every stage; the hit
        tokens when every stage loaded, else 0 (a miss, never wrong data).
        Raises :class:`SlotsStillWrittenError` (after the group's verdict, a miss)
        when this stage's copy did not stop after its timeout and cancel: it may
        still write the slots, so the engine must not reuse them."""
        g = self._open_get(rid, "retrieve")
        self.counters.retrieves += 1
        if g.task_id < 0:
            return 0
        if self.newer_epoch is not None:
            self._end_get(rid, g, ok=False)
            self.counters.retrieve_misses += 1
            return 0
        try:
            slots = prepare_slots(slot_mapping, g.hit, self.num_slots,  # type: ignore[arg-type]
                                  self.cfg.whole_pages)
        except ValueError:
            self._end_get(rid, g, ok=False)
            raise
        ok = g.acks.wait(self.cfg.fanout_wait_seconds + self.cfg.transfer_seconds)
        ok = ok and self.newer_epoch is None and not self._verdict_late(rid, g)
        still_writing = False
        if ok:
            try:
                ids = self.backend.launch([g.task_id], [slots])
                ends = [self._end_copy(rid, tid, self.cfg.transfer_seconds) for tid in ids]
                still_writing = any(e is None for e in ends)
                ok = all(e is KVResponseStatus.SUCCESS for e in ends)
            except Exception as exc:
                log.warning("Leader load failed", extra={"group": self.cfg.group, "rid": rid,
                                                         "error": str(exc)})
                ok = False
        else:
            log.warning("Not every follower loaded, the retrieve is a miss",
                        extra={"group": self.cfg.group, "rid": rid, "missing": g.acks.missing(),
                               "failed": [a.error for a in g.acks.failed()]})
        # Every follower answered and one could not load (say, its fetch of the
        # blocks from the remote tier failed): the next lookup that loads those
        # blocks fetches them again on the followers, so it can hit.
        ok = self._end_get(rid, g, ok,
                           refetch=not ok and g.acks.done() and bool(g.acks.failed()))
        if not ok:
            self.counters.retrieve_misses += 1
        if still_writing:
            # Not a miss: a miss lets the engine recompute into (or reuse) the slots
            # this copy may still write.
            self.counters.loads_still_writing += 1
            raise SlotsStillWrittenError(
                rid, f"the leader (pp rank {self.cfg.pp_rank})",
                f"transfer_seconds={self.cfg.transfer_seconds:g}s, then "
                f"{min(STOP_WAIT_SECONDS, self.cfg.transfer_seconds):g}s after its cancel")
        return g.hit if ok else 0

    def expected_followers(self) -> bool:
        """Whether this leader's group has followers (their stages load their own
        layers, so its loads are never handed to an engine)."""
        return bool(self._expected())

    def claim_load(self, rid: str) -> tuple[int, list[int], int] | None:
        """Hand ``rid``'s looked-up load to the engine to copy itself: ``(hit
        tokens, the CPU tier block of each hit block in token order, the claim's
        id)``, pinned for ``transfer_seconds`` or until :meth:`commit_load` of that
        id; ``(0, [], -1)`` for a miss.
        None when the engine cannot copy it (a group with followers, whose stages
        each load their own layers; no shared tier; a block not on the CPU tier):
        the lookup stays open for :meth:`retrieve`."""
        if self._expected():
            return None
        g = self._open_get(rid, "claim_load")
        self.counters.retrieves += 1
        if g.task_id < 0:
            return 0, [], -1
        if self.newer_epoch is not None:
            self._end_get(rid, g, ok=False)
            self.counters.retrieve_misses += 1
            return 0, [], -1
        try:
            rows = self.backend.claim_rows(g.task_id, self.cfg.transfer_seconds)
        except Exception as exc:  # expired or cancelled since the lookup: a miss
            log.warning("Leader could not claim a load, answering a miss",
                        extra={"group": self.cfg.group, "rid": rid, "error": str(exc)})
            self._end_get(rid, g, ok=False)
            self.counters.retrieve_misses += 1
            return 0, [], -1
        ended: list[_Get] = []
        with self._state:
            if rows is None:
                g.used = False
                self.counters.retrieves -= 1  # counted by the retrieve that follows
                return None
            if self._gets.get(rid) is not g:
                # A new lookup or a release of the rid came while this claim was
                # made: it could not end a claim not yet recorded, so it ends here.
                ended.append(g)
            else:
                g.claimed = True
                del self._gets[rid]
                old = self._claimed.pop(rid, None)
                if old is not None:
                    ended.append(old)
                self._claimed[rid] = g
                while len(self._claimed) > self.cfg.max_pending:
                    ended.append(self._claimed.popitem(last=False)[1])
        for e in ended:  # claims no commit will end: their commits answer False
            self.backend.end_claim(e.task_id, committed=False)
        if g in ended:
            self.counters.retrieve_misses += 1
            return 0, [], -1
        self.counters.claimed_loads += 1
        return g.hit, rows, g.task_id

    def commit_load(self, rid: str, claim: int) -> bool:
        """The engine's copy of ``rid``'s claimed load ended: True when its blocks
        stayed pinned throughout (the engine's slots hold the cached KV), False when
        the claim ended first (its lease, a flush, a release or new lookup of the
        rid, more open claims than ``max_pending``): the slots hold undefined data,
        a miss. ``claim``: the id :meth:`claim_load` answered; a commit naming
        another claim of the rid (one that already ended) answers False and leaves
        the rid's live claim alone."""
        with self._state:
            g = self._claimed.get(rid)
            if g is not None and g.task_id == claim:
                del self._claimed[rid]
            else:
                g = None
        ok = g is not None and self.backend.end_claim(g.task_id)
        if not ok:
            self.counters.retrieve_misses += 1
            self.counters.claims_expired += 1
        return ok

    def _verdict_late(self, rid: str, g: _Get) -> bool:
        """Whether an ok verdict for ``g`` could reach a follower after it gave up.

        A follower that loaded waits ``fanout_wait_seconds + transfer_seconds``
        after its ack for the verdict, then answers 0 and its engine reuses the
        slots; a leader that answered the hit after that would leave its stage
        with a prefix another stage does not hold (a load is all or nothing).
        So the leader answers a miss when that wait, less a margin for the
        messages' transit (:data:`VERDICT_MARGIN_FRACTION`, at least
        :data:`VERDICT_MARGIN_SECONDS`), has passed since the first ack came."""
        first = g.acks.first_at
        if first is None:
            return False
        wait = self.cfg.fanout_wait_seconds + self.cfg.transfer_seconds
        margin = max(VERDICT_MARGIN_FRACTION * wait, VERDICT_MARGIN_SECONDS)
        late = time.monotonic() - first
        if late < wait - margin:
            return False
        self.counters.late_verdict_misses += 1
        log.warning("Retrieve too late for the followers' verdict wait, answering a miss",
                    extra={"group": self.cfg.group, "rid": rid,
                           "since_ack_seconds": round(late, 3), "follower_wait_seconds": wait})
        return True

    def _end_get(self, rid: str, g: _Get, ok: bool, refetch: bool = False) -> bool:
        """Send ``rid``'s verdict and forget its get; returns the verdict sent. An ok
        verdict is checked once more for lateness with the decision lock held: a
        flush or another decision may have held that lock past the followers' wait."""
        with self._decide:
            if ok and self._verdict_late(rid, g):
                ok = False
            if refetch:
                self.backend.refetch_failed(g.task_id)
            if not ok:
                self.backend.cancel([g.task_id])
            self.stream.broadcast(Op.RESULT, Result(rid, Kind.GET, g.n, g.task_id, ok))
        with self._state:
            if self._gets.get(rid) is g:
                del self._gets[rid]
        return ok

    # -- lifecycle -------------------------------------------------------------------------

    def release(self, rid: str) -> None:
        """The engine is done with ``rid``: cancel its un-used load, start the
        rid's next life and tell the followers (the leader's next decisions for
        ``rid`` carry that life)."""
        self._cancel_get(rid)
        with self._decide:
            self.stream.broadcast(Op.RELEASE, Release(rid, self._lives.release(rid)))

    def take_unreported(self) -> list[str]:
        """After :meth:`close`: rids the engine was never told are complete (queued
        ones and stores still in flight, whose copies the backend shutdown ended)."""
        with self._state:
            out = self._completed.drain() + [t.rid for t in self._puts.values()]
            self._puts.clear()
        return out

    def reset(self) -> None:
        """Flush the whole group's cache."""
        self._flush("engine reset")

    def _flush(self, reason: str) -> None:
        with self._decide:
            self.counters.flushes += 1
            epoch = self._cache_epoch()  # read before the reset: a later switch refuses
            self.backend.reset()
            self._content_epoch = epoch
            with self._state:
                ended = [t.rid for t in self._puts.values()]
                self._puts.clear()
                # The reset voided every open lookup's task: its retrieve is a miss
                # (a retrieve already running keeps its own entry and ends as one).
                for rid, g in list(self._gets.items()):
                    if not g.used:
                        self._gets[rid] = _Get(g.n, -1, 0, AckCollector(frozenset()))
                self._completed.add(ended)
            self.stream.broadcast(Op.RESET, Reset(reason))
        log.info("Group cache flushed", extra={"group": self.cfg.group, "reason": reason,
                                                "epoch": self.epoch})

    def handle(self, msg: Message) -> None:
        """A message from a follower (server thread)."""
        if msg.env.op in (Op.HELLO, Op.ACK):
            self.stream.handle(msg)
        else:
            # Another process claims leadership of this group; epochs decide.
            newer = msg.env.epoch > self.epoch
            self.stream.drop("future_epoch" if newer else "stale_epoch")
            if newer:
                self.step_down(msg.env.epoch)

    def step_down(self, epoch: int) -> None:
        """Stop deciding: a leader of the newer ``epoch`` exists (its stream or a
        follower's HELLO/ACK reached this stage before the group view did).

        From now on every engine call answers -1 / a miss at once (followers
        still on this epoch get an error decision, so none waits), no put is
        published: each in-flight one is discarded once its local copy ended,
        and the role stays like this until the connector's view replaces it.
        Idempotent; safe from any thread.
        """
        if epoch <= self.epoch or self.newer_epoch is not None:
            return
        self.newer_epoch = epoch
        self._stats.step_down()
        log.warning("Leader stepped down: a newer epoch exists",
                    extra={"group": self.cfg.group, "epoch": self.epoch, "newer_epoch": epoch})
        self._wake.set()

    def degraded(self) -> bool:
        """True when some follower is not synced or this leader stepped down."""
        return self.newer_epoch is not None or not self.stream.all_synced()

    def status(self) -> dict[str, object]:
        """Role-specific part of the connector's status."""
        with self._state:
            puts, gets = len(self._puts), len(self._gets)
        tiers: dict[str, object]
        try:
            tiers = {k: dict(vars(v)) for k, v in self.backend.stats().tiers.items()}
        except Exception as exc:  # status must answer even when the backend cannot
            tiers = {"error": str(exc)}
        return {
            "role": self.role,
            "epoch": self.epoch,
            "tiers": tiers,
            "lastSeq": self.stream.seq,
            "peersConnected": self.stream.synced_count(),
            "peersExpected": len(self.stream.follower_ranks),
            "degraded": self.degraded(),
            "inflightStores": puts,
            "openLookups": gets,
            "steppedDownFor": self.newer_epoch,
            "completedQueued": len(self._completed),
            "completedDropped": self._completed.dropped,
            "counters": {k: v for k, v in vars(self.counters).items() if k != "extra"},
        }

    def close(self, shutdown_backend: bool = True) -> None:
        """Stop the reaper and the stream; shut the backend down."""
        self._stop.set()
        self._wake.set()
        self.backend.set_completion_listener(None)
        if self._reaper.is_alive():
            # Bounded by the reaper's longest step (wait, cancel, wait) so that
            # take_unreported sees every put it did not finish.
            self._reaper.join(timeout=self.cfg.transfer_seconds + STOP_WAIT_SECONDS + 1.0)
        self.stream.close()
        if shutdown_backend:
            self.backend.shutdown()

"""A follower stage's side of the coordinator: it never matches, allocates or evicts.

Each engine call waits (bounded) for the leader's decision made for the same
content: the same rid, kind and token digest, in the same life of the rid
(:class:`DecisionBook`). A decision with another digest is never applied: a
call that ends without its own decision while another one of its rid and kind
is pending is a *mismatch* (counted, the call answers -1 / a miss, the stage
resyncs). The call applies the decision's mask to its own inputs, executes the
physical plan on its own :class:`StageStore`, then acks the outcome to the
leader. Stream messages (moves, cancels, results, releases, resets) are
applied on the server thread in stream order.

Copies run under one *execution lock*: a message that frees blocks (a failed
put's RESULT, a load's CANCEL, RESET, MOVES, a broken stream) takes that lock
first, so no copy that started before it can touch a block a later plan
reuses, and it marks the task so no copy starts after it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from node_agent.backend.replication import CopyStillRunningError, StageStore
from node_agent.coordinator.config import CoordinatorConfig
from node_agent.coordinator.errors import SlotsStillWrittenError, UnknownRequestError
from node_agent.coordinator.inputs import LookupInput, StoreInput, prepare_slots
from node_agent.coordinator.tracking import CompletedRids, DecisionBook, Key, Mailbox, Taken
from node_agent.pp.auth import CurveKeys
from node_agent.pp.messages import (
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
from node_agent.pp.stream import FollowerStream, StreamMetrics
from node_agent.vocab.placement import Direction, Tier

log = logging.getLogger(__name__)

Stamped = tuple[int, int, Decision]
"""A decision as delivered: (stream generation, leader incarnation, decision)."""


class _StillWriting(str):
    """The error of a copy that did not stop after its abort: it may still touch
    the engine's slots (:meth:`FollowerRole._execute`)."""


@dataclass
class FollowerCounters:
    """Totals reported in ``status()``."""

    stores: int = 0
    stores_executed: int = 0
    store_failures: int = 0
    decision_timeouts: int = 0
    mismatches: int = 0
    decisions_unpaired: int = 0
    lookups: int = 0
    retrieves: int = 0
    retrieve_misses: int = 0
    loads_still_writing: int = 0
    """Retrieves answered ``SlotsInUse``: their load copy did not stop."""
    late_load_verdicts: int = 0
    """Ok load verdicts that came after this stage's retrieve answered 0."""
    moves_applied: int = 0
    resets: int = 0
    cache_epoch_refusals: int = 0


class FollowerRole:
    """Follower of one group under one epoch (see module docstring)."""

    role = "follower"

    def __init__(
        self,
        cfg: CoordinatorConfig,
        epoch: int,
        leader_endpoint: str | None,
        store: StageStore,
        keys: CurveKeys | None,
        stats: StreamMetrics,
        num_slots: int | None,
        on_completed: Callable[[], None] | None = None,
        cache_epoch: Callable[[], int] | None = None,
    ) -> None:
        """``on_completed()``: called whenever rids become reportable by
        :meth:`poll_completed` (the connector's completion notification).
        ``cache_epoch()``: this agent's current ``cacheEpoch`` (the remote tier's
        key epoch): decisions and remote moves of another epoch are refused."""
        self.cfg = cfg
        self._cache_epoch = cache_epoch or (lambda: 0)
        self.epoch = epoch
        self.store = store
        self.num_slots = num_slots
        self.counters = FollowerCounters()
        # Each decision is stamped with the stream generation it was delivered
        # under (in stream order), so a decision that a RESET or resync made
        # stale is refused even when its engine call takes it afterwards, and
        # with the leader incarnation that made it, which every ack of it carries.
        self._book: DecisionBook[Stamped] = DecisionBook(cfg.max_pending)
        self._results: Mailbox[Result] = Mailbox(cfg.max_pending)
        self._stats = stats
        self._exec = threading.Lock()
        self._state = threading.Lock()
        self._gen = 0
        self._buffers_gen = 0
        """Bumped by every buffer registration (:meth:`swap_buffers`): a call that
        began under another number never copies (its engine registered again)."""
        self._call = threading.local()
        """The engine call running on this thread: ``buffers_gen`` when it began."""
        self._cancelled: OrderedDict[Key, None] = OrderedDict()
        self._gets: OrderedDict[str, Stamped] = OrderedDict()
        self._stored: OrderedDict[Key, str] = OrderedDict()
        """Stores this stage answered (or is copying) with the leader's task id,
        until the leader's RESULT: their rids go to ``poll_completed`` then."""
        self._missed: OrderedDict[str, None] = OrderedDict()
        """Rids whose last lookup answered 0: their retrieve answers 0 (a miss)."""
        self._completed = CompletedRids(cfg.max_completed, stats.completed_dropped,
                                        on_completed)
        self.stream = FollowerStream(
            cfg.group, cfg.pp_rank, keys, stats, apply=self._apply,
            on_unsynced=self._on_unsynced, on_dropped=self._on_dropped,
            on_new_leader=self._on_new_leader,
            hello_interval=max(cfg.heartbeat_seconds * 2.5, 0.05),
            leader_timeout=cfg.leader_timeout_seconds,
        )
        self._leader_endpoint = leader_endpoint

    def start(self) -> None:
        """Connect to the leader and say HELLO; call once the role receives
        messages (its SYNC answer must not find the role missing)."""
        self.stream.follow(self.epoch, self._leader_endpoint)

    def follow_endpoint(self, leader_endpoint: str | None) -> None:
        """The group view moved the leader to ``leader_endpoint`` under the same
        epoch (a restarted leader with a new address): resync to it now."""
        if leader_endpoint != self._leader_endpoint:
            self._leader_endpoint = leader_endpoint
            self.stream.follow(self.epoch, leader_endpoint)

    # -- helpers -------------------------------------------------------------------------

    def _ack(self, inc: int, kind: Kind, rid: str, n: int, task_id: int, ok: bool,
             error: str | None = None) -> None:
        """Answer a decision of leader incarnation ``inc`` (only that process
        counts the ack, whatever this stage follows by the time it is sent)."""
        self.stream.send_ack(Ack(self.cfg.pp_rank, rid, kind, n, task_id, ok,
                                 None if error is None else str(error)), inc)  # a plain str

    def _refuse_unpaired(self, values: list[Stamped]) -> None:
        """Decisions no call of this stage will take: never applied; a failure
        ack lets the leader end their task at once instead of at its deadline."""
        for _, inc, d in values:
            self.counters.decisions_unpaired += 1
            if d.active:
                kind = Kind.PUT if d.direction is Direction.STORE else Kind.GET
                self._ack(inc, kind, d.rid, d.n, d.task_id, False,
                          f"stage {self.cfg.pp_rank} made no {kind.value} call for these "
                          "tokens")

    def _unpaired(self, kind: Kind, rid: str, taken: Taken[Stamped]) -> None:
        """A call ended without its decision: a timeout, or a mismatch (another
        decision of its rid and kind was pending): count it and resync. A
        decision the leader ended before the call took it is neither."""
        if taken.withdrawn:
            return
        if not taken.mismatch:
            self.counters.decision_timeouts += 1
            return
        self.counters.mismatches += 1
        self._stats.mismatch(kind.value)
        log.warning("Leader decision does not match this stage's call, resyncing",
                    extra={"group": self.cfg.group, "rid": rid, "kind": kind.value})
        self.stream.request_resync(f"{kind.value} decision for {rid!r} does not match the "
                                   "stage's tokens")

    def _other_epoch(self, kind: Kind, rid: str, d: Decision) -> str | None:
        """Why ``d`` must not be applied on this stage (None when it may): it was
        made under another cache epoch than this stage's. Counts the refusal."""
        own = self._cache_epoch()
        if d.cache_epoch == own:
            return None
        self.counters.cache_epoch_refusals += 1
        self._stats.cache_epoch_refused(kind.value)
        log.warning("Leader decision of another cache epoch refused",
                    extra={"group": self.cfg.group, "rid": rid, "kind": kind.value,
                           "decision_epoch": d.cache_epoch, "stage_epoch": own})
        return (f"stage {self.cfg.pp_rank} is on cacheEpoch {own} but the leader decided "
                f"under cacheEpoch {d.cache_epoch}")

    def _wait_s(self) -> float:
        return min(self.cfg.fanout_wait_seconds, self.cfg.engine_call_seconds)

    def swap_buffers(self, register: Callable[[], None]) -> None:
        """Run ``register()`` (an engine rank registering its buffers) while no copy
        runs, and make every engine call begun before it refuse to copy: its slots
        name the buffers of the engine that made it, which may be gone (a restarted
        engine registers new buffers while its predecessor's call still waits for
        its decision). Raises ``TimeoutError`` when a copy held the stage for more
        than ``transfer_seconds`` (nothing registered; register again)."""
        if not self._exec.acquire(timeout=self.cfg.transfer_seconds):
            raise TimeoutError(
                f"a copy of stage {self.cfg.pp_rank} ran for more than transfer_seconds="
                f"{self.cfg.transfer_seconds:g}s while an engine rank registered its "
                "buffers; nothing was registered, register again")
        try:
            self._buffers_gen += 1
            register()
        finally:
            self._exec.release()

    def _begin_call(self) -> None:
        """Note the buffer registration an engine call on this thread began under."""
        self._call.buffers_gen = self._buffers_gen

    def _execute(self, key: Key, gen: int, d: Decision,
                 slots: npt.NDArray[np.int64], stop_timeout: float | None = None) -> str | None:
        """Run ``d`` (delivered under stream generation ``gen``) with ``slots``;
        None on success, else the error (a :class:`_StillWriting` when the copy did
        not stop after its abort and may still touch ``slots``). Refused when a reset or resync came
        after the decision, the leader cancelled it, or an engine rank registered
        its buffers since this thread's call began (:meth:`_begin_call`)."""
        if not self._exec.acquire(timeout=self.cfg.transfer_seconds):
            return (f"another copy on this stage held the copy lock for more than "
                    f"transfer_seconds={self.cfg.transfer_seconds:g}s; raise "
                    "timeouts.engineCallSeconds (transfer_seconds is split from it) or "
                    "look for a stuck tier")
        timed_out = False
        try:
            if gen != self._gen:
                return "the stream was reset or resynced after the leader's decision"
            if key in self._cancelled:
                return "the leader cancelled the task"
            if getattr(self._call, "buffers_gen", self._buffers_gen) != self._buffers_gen:
                return ("the engine registered its KV buffers again after this call began: "
                        "its slots name buffers that are gone")
            plan = d.plan
            assert plan is not None
            self.store.execute(plan, slots, timeout=self.cfg.transfer_seconds,
                               stop_timeout=stop_timeout)
            return None
        except CopyStillRunningError as exc:
            timed_out = True
            return _StillWriting(exc)
        except TimeoutError as exc:
            timed_out = True
            return str(exc)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            self._exec.release()
            if timed_out:
                # The copy may still be running: no later plan may be applied over it.
                self.stream.request_resync("copy timed out")

    def _fence(self) -> bool:
        """Wait until no copy runs (bounded by ``transfer_seconds``: it may run
        on the agent-wide fan-out server thread); False when one is stuck."""
        if self._exec.acquire(timeout=self.cfg.transfer_seconds):
            self._exec.release()
            return True
        return False

    def _mark_cancelled(self, key: Key) -> None:
        with self._state:
            self._cancelled[key] = None
            while len(self._cancelled) > self.cfg.max_pending:
                self._cancelled.popitem(last=False)

    # -- store -----------------------------------------------------------------------------

    def store_kv(self, rid: str, inp: StoreInput) -> int:
        """Wait for the leader's decision for these tokens, execute it, ack it."""
        self.counters.stores += 1
        self._begin_call()
        if inp.aligned == 0 or not self.stream.synced:
            return -1
        taken = self._book.take(rid, Kind.PUT, inp.digest, self._wait_s())
        self._refuse_unpaired(taken.skipped)
        if taken.value is None:
            self._unpaired(Kind.PUT, rid, taken)
            return -1
        gen, inc, d = taken.value
        if not d.active or d.error:
            return -1
        key: Key = (rid, Kind.PUT, d.n)
        refused = self._other_epoch(Kind.PUT, rid, d)
        if refused is not None:
            self._ack(inc, Kind.PUT, rid, d.n, d.task_id, False, refused)
            return -1
        tpb = self.cfg.tokens_per_block
        error: str | None = None
        if len(d.mask) != inp.aligned:
            error = (f"stage {self.cfg.pp_rank} has {inp.aligned} aligned tokens for {rid!r} "
                     f"but the leader decided over {len(d.mask)}")
        elif int(np.count_nonzero(d.mask)) != d.num_blocks * tpb:
            error = (f"decision mask covers {int(np.count_nonzero(d.mask))} tokens but its "
                     f"plan has {d.num_blocks} blocks of {tpb}")
        else:
            with self._state:
                # Registered before the copy: a RESULT that ends the task while
                # the copy runs reports the rid (after its fence waited for it).
                self._stored[key] = rid
            error = self._execute(key, gen, d, inp.slots.select(d.mask))
        if error is None and gen != self._gen:
            error = "the stream was reset or resynced while the copy ran"
        with self._state:
            if error is not None and self._stored.pop(key, None) is not None \
                    and gen != self._gen:
                # The reset ended the leader's task: report the rid so the engine
                # frees its source slots (the copy no longer reads them).
                self._completed.add([rid])
            while len(self._stored) > self.cfg.max_pending:
                self._completed.add([self._stored.popitem(last=False)[1]])
        if error is None:
            self.counters.stores_executed += 1
        else:
            self.counters.store_failures += 1
            log.warning("Stage failed to store", extra={"group": self.cfg.group, "rid": rid,
                                                        "error": error})
        self._ack(inc, Kind.PUT, rid, d.n, d.task_id, error is None, error)
        return d.task_id if error is None else -1

    def poll_completed(self) -> list[str]:
        """Rids whose store the leader finished (published or discarded)."""
        return self._completed.drain()

    # -- load ------------------------------------------------------------------------------

    def lookup(self, rid: str, inp: LookupInput) -> int:
        """The leader's hit for this lookup (0 on timeout, error or mismatch)."""
        self.counters.lookups += 1
        with self._state:
            self._gets.pop(rid, None)
            self._missed[rid] = None  # until a hit replaces it
            while len(self._missed) > self.cfg.max_pending:
                self._missed.popitem(last=False)
        if not self.stream.synced:
            return 0
        taken = self._book.take(rid, Kind.GET, inp.digest, self._wait_s())
        self._refuse_unpaired(taken.skipped)
        if taken.value is None:
            self._unpaired(Kind.GET, rid, taken)
            return 0  # a late decision is answered with a failure ack on arrival
        gen, inc, d = taken.value
        if not d.active or d.error or gen != self._gen:
            return 0
        refused = self._other_epoch(Kind.GET, rid, d)
        if refused is not None:
            self._ack(inc, Kind.GET, rid, d.n, d.task_id, False, refused)
            return 0
        if len(d.mask) != len(inp.tokens):
            self._ack(inc, Kind.GET, rid, d.n, d.task_id, False,
                      f"stage {self.cfg.pp_rank} looked up {len(inp.tokens)} tokens for "
                      f"{rid!r} but the leader matched {len(d.mask)}")
            return 0
        with self._state:
            self._missed.pop(rid, None)
            self._gets[rid] = taken.value
            while len(self._gets) > self.cfg.max_pending:
                self._gets.popitem(last=False)
        return int(np.count_nonzero(d.mask))

    def retrieve(self, rid: str, slot_mapping: object) -> int:
        """Load this stage's layers; the hit when every stage loaded, else 0.
        Raises :class:`SlotsStillWrittenError` when the copy did not stop after its
        timeout and abort: it may still write the slots (a miss on the other stages)."""
        self._begin_call()
        with self._state:
            entry = self._gets.pop(rid, None)
        if entry is None:
            with self._state:
                missed = self._missed.pop(rid, "absent") is None
            if missed:
                return 0  # the lookup missed: same answer as the leader
            raise UnknownRequestError(rid, "retrieve", "call lookup first")
        gen, inc, d = entry
        n = d.n
        key: Key = (rid, Kind.GET, n)
        self.counters.retrieves += 1
        hit = int(np.count_nonzero(d.mask))
        try:
            slots = prepare_slots(slot_mapping, hit, self.num_slots,  # type: ignore[arg-type]
                                  self.cfg.whole_pages)
        except ValueError as exc:
            self._ack(inc, Kind.GET, rid, n, d.task_id, False, str(exc))
            raise
        # An aborted copy may take the verdict wait's share of the call budget to
        # stop (it waits for no verdict then): copy lock + copy + stop stay within
        # fanout + 3 x transfer, so the engine is answered before the server's
        # last resort and learns that the slots may still be written.
        error = self._execute(key, gen, d, slots,
                              stop_timeout=self.cfg.fanout_wait_seconds
                              + self.cfg.transfer_seconds)
        self._ack(inc, Kind.GET, rid, n, d.task_id, error is None, error)
        if isinstance(error, _StillWriting):
            # Not a miss: a miss lets the engine recompute into (or reuse) the
            # slots this copy may still write. The failure ack makes it a miss on
            # every other stage.
            self.counters.retrieve_misses += 1
            self.counters.loads_still_writing += 1
            raise SlotsStillWrittenError(rid, f"PP stage {self.cfg.pp_rank}", error)
        verdict = None
        if error is None:
            verdict = self._results.take(key, self.cfg.fanout_wait_seconds
                                         + self.cfg.transfer_seconds)
        if verdict is None or not verdict.ok:
            self.counters.retrieve_misses += 1
            return 0
        return hit

    # -- stream ----------------------------------------------------------------------------

    def _apply(self, msg: Message) -> None:
        """Apply one in-order message; any failure makes the stage resync (the
        leader flushes the group on the HELLO) instead of staying synced on a
        state that no longer matches the leader's."""
        try:
            self._apply_one(msg)
        except Exception as exc:
            log.exception("Stage failed to apply a leader message, resyncing",
                          extra={"group": self.cfg.group, "op": msg.env.op.name})
            self.stream.request_resync(
                f"applying {msg.env.op.name} failed: {type(exc).__name__}: {exc}")

    def _apply_one(self, msg: Message) -> None:
        body = msg.body
        if isinstance(body, Decision):
            kind = Kind.PUT if msg.env.op is Op.PUT else Kind.GET
            stamped = (self._gen, msg.env.incarnation, body)
            if not self._book.deliver(body.rid, kind, body.digest, body.life, stamped) \
                    and body.active:
                # This stage's call already gave up (or its life of the rid
                # ended): answer now so the leader ends the task at once.
                self._ack(msg.env.incarnation, kind, body.rid, body.n, body.task_id, False,
                          f"the stage's {kind.value} call gave up before the decision arrived")
            self._refuse_unpaired(self._book.take_evicted())
        elif isinstance(body, Moves):
            if not self._exec.acquire(timeout=self.cfg.transfer_seconds):
                self.stream.request_resync("moves could not wait for a running copy")
                return
            try:
                own = self._cache_epoch()
                remote = body.cache_epoch == own
                if not remote:
                    self._refuse_remote_moves(body, own)
                self.store.apply_moves(body.moves, remote=remote)
                self.counters.moves_applied += len(body.moves)
            except Exception as exc:
                # This stage no longer holds the leader's blocks: stop applying
                # and have the leader flush the group (its answer to the HELLO).
                log.warning("Stage failed to apply moves, resyncing",
                            extra={"group": self.cfg.group, "error": str(exc)})
                self.stream.request_resync(f"moves failed: {type(exc).__name__}: {exc}")
            finally:
                self._exec.release()
        elif isinstance(body, Result):
            self._on_result(body)
        elif isinstance(body, Cancel):
            key: Key = (body.rid, body.kind, body.n)
            self._withdraw(body.rid, body.kind, body.n, body.task_id)
            self._mark_cancelled(key)
            if not self._fence():
                self.stream.request_resync("a copy did not end after its cancel")
        elif isinstance(body, Release):
            # The leader's next decisions for the rid belong to its next life;
            # decisions of this life stay for this stage's own (maybe lagging) calls.
            self._book.stream_release(body.rid, body.life)
        elif isinstance(body, Reset):
            self._reset_local(body.reason)

    def _miss_open_lookups(self) -> None:
        """A flush or resync voided every open lookup's decision: their retrieve
        answers 0 (a miss), like the leader's (``_state`` held)."""
        for rid in self._gets:
            self._missed[rid] = None
        while len(self._missed) > self.cfg.max_pending:
            self._missed.popitem(last=False)
        self._gets.clear()

    def _refuse_remote_moves(self, body: Moves, own: int) -> None:
        """Count the REMOTE moves of ``body`` (made under another cache epoch than
        this stage's ``own``) that are refused: no other epoch's object is fetched
        or written."""
        fetches = sum(1 for m in body.moves if m.src.tier is Tier.REMOTE)
        writes = sum(1 for m in body.moves if m.dst is not None and m.dst.tier is Tier.REMOTE)
        if fetches:
            self._stats.cache_epoch_refused("fetch", fetches)
        if writes:
            self._stats.cache_epoch_refused("write", writes)
        if fetches or writes:
            self.counters.cache_epoch_refusals += fetches + writes
            log.warning("Remote moves of another cache epoch refused",
                        extra={"group": self.cfg.group, "moves_epoch": body.cache_epoch,
                               "stage_epoch": own, "fetches": fetches, "writes": writes})

    def _withdraw(self, rid: str, kind: Kind, n: int, task_id: int) -> None:
        """The leader ended decision ``n`` of ``rid``: if no call took it yet, no
        call ever applies it (a lagging call of a later life included; the
        leader may already reuse its blocks)."""
        self._book.withdraw(rid, kind, lambda v: (v[2].n, v[2].task_id) == (n, task_id))

    def _on_result(self, r: Result) -> None:
        key: Key = (r.rid, r.kind, r.n)
        if not r.ok:
            self._withdraw(r.rid, r.kind, r.n, r.task_id)
            self._mark_cancelled(key)
            if not self._fence():
                self.stream.request_resync("a copy did not end after its discard")
        if r.kind is Kind.GET:
            if not self._results.put(key, r) and r.ok:
                # This stage's retrieve already answered 0 (its verdict wait ran
                # out): the leader's engine keeps the prefix this one recomputes.
                # Not closable by one more message (its own could be late too);
                # counted so the disagreement is visible (docs/pp.md, "Loads").
                self.counters.late_load_verdicts += 1
                log.warning("Leader's ok load verdict came after this stage answered a "
                            "miss; the stages disagree on this load",
                            extra={"group": self.cfg.group, "rid": r.rid, "n": r.n})
            return
        with self._state:
            if self._stored.pop(key, None) is not None:
                self._completed.add([r.rid])

    def _reset_local(self, reason: str, new_leader: bool = False) -> None:
        """Flush this stage. A RESET in the stream keeps the decision book: the
        lives of each rid go on in step with the leader's, and the decisions it
        holds are refused by their stale generation when their calls take them.
        A new leader process numbers lives from 0: the book is rebased on it."""
        self._gen += 1
        if new_leader:
            self._book.rebase()
        self._results.fail_waiters()
        if not self._fence():
            log.error("A copy did not end before a reset", extra={"group": self.cfg.group})
        self.store.reset()
        self.counters.resets += 1
        with self._state:
            self._miss_open_lookups()
            self._completed.add(self._stored.values())
            self._stored.clear()
        log.info("Stage flushed", extra={"group": self.cfg.group, "reason": reason})

    def _on_unsynced(self, reason: str) -> None:
        self._gen += 1
        self._book.fail_waiters()
        self._results.fail_waiters()
        copies_ended = self._fence()
        with self._state:
            self._miss_open_lookups()
            if copies_ended:
                # This stage never sees the RESULT (or RESET) that ends these
                # stores: the leader sends neither to an unsynced stage, and it
                # flushes a dirty group before its SYNC. Their copies ended here:
                # report them now, or the engine would wait for them for ever.
                self._completed.add(self._stored.values())
                self._stored.clear()

    def _on_new_leader(self, reason: str) -> None:
        """Another leader process (a new incarnation or endpoint) took over the
        stream: nothing this stage holds was decided by it. Flush the local
        store and report every store the old leader will never finish."""
        self._reset_local(reason, new_leader=True)

    def _on_dropped(self, msg: Message) -> None:
        body = msg.body
        if isinstance(body, Decision) and msg.env.op is Op.PUT and body.active:
            self._ack(msg.env.incarnation, Kind.PUT, body.rid, body.n, body.task_id, False,
                      "decision dropped: the stage's stream was out of sync")

    # -- lifecycle -------------------------------------------------------------------------

    def release(self, rid: str) -> None:
        """End ``rid`` on this stage: its decisions no call took (answered with
        failure acks), its open lookup, its cancel marks and verdicts. A reused
        rid starts clean; stores still in flight are still reported."""
        self._refuse_unpaired(self._book.release(rid))
        self._results.discard_rid(rid)
        with self._state:
            self._gets.pop(rid, None)
            self._missed.pop(rid, None)
            for key in [k for k in self._cancelled if k[0] == rid]:
                del self._cancelled[key]

    def reset(self) -> None:
        """Local part of an engine reset (the leader flushes the group)."""
        with self._state:
            self._miss_open_lookups()

    def handle(self, msg: Message) -> None:
        """A message from the leader (server thread)."""
        if msg.env.op in (Op.HELLO, Op.ACK):
            self.stream.drop("stale_epoch")  # meant for a leader; this stage follows
        else:
            self.stream.handle(msg)

    def degraded(self) -> bool:
        """True while this stage is not synced with its leader."""
        return not self.stream.synced

    def status(self) -> dict[str, object]:
        """Role-specific part of the connector's status."""
        return {
            "role": self.role,
            "epoch": self.epoch,
            "lastSeq": self.stream.last_seq,
            "peersConnected": 1 if self.stream.synced else 0,
            "peersExpected": 1,
            "degraded": self.degraded(),
            "completedQueued": len(self._completed),
            "completedDropped": self._completed.dropped,
            "counters": dict(vars(self.counters)),
            "leaderIncarnation": self.stream.incarnation,
        }

    def close(self) -> None:
        """Stop the stream; pending calls end empty-handed; wait (bounded) for a
        running copy to end."""
        self.stream.close()
        self._gen += 1
        self._book.fail_waiters()
        self._results.fail_waiters()
        if not self._fence():
            log.error("A copy did not end before the role closed",
                      extra={"group": self.cfg.group, "epoch": self.epoch})

    def take_unreported(self) -> list[str]:
        """After :meth:`close`: rids the engine was never told are complete
        (queued ones and stores executed here but not yet finished by the leader)."""
        with self._state:
            out = self._completed.drain() + list(self._stored.values())
            self._stored.clear()
        return out

"""The scheduler half of the vLLM connector: every data call to the agent.

Where data calls are made: here, in vLLM's scheduler process, never in the
workers. The agent moves the KV of every TP rank of a stage in one call (only TP
rank 0 may call ``lookup``/``retrieve``/``store_kv``), so one ``retrieve`` either
loads a request's blocks on every rank or reports a miss for all of them: a
request is never half loaded across TP ranks, and workers need no agreement
protocol. Workers only register their KV buffers (and re-register after an
agent restart).

Flow of one request (``rid`` = vLLM's request id):

* admission, ``lookup`` (in the scheduler loop, bounded by ``lookupTimeoutSeconds``):
  tokens from the block-aligned local hit up to the last whole block before the
  final token (vLLM always computes the last token); once per request: while it
  waits for admission, vLLM's repeated asks get the same answer without a call
  (until its tokens change, or :data:`LOOKUP_REUSE_SECONDS` pass);
* after allocation, a ``retrieve`` into the request's newly allocated blocks runs
  on the load thread; success -> ``finished_recving``; failure -> the blocks are
  sent to the workers, which report them as ``invalid_block_ids`` in the same
  step their metadata names the rid, and vLLM recomputes them; ``SlotsInUse``
  (the agent's copy did not stop and may still write the blocks) -> the load is
  never reported and the blocks are never freed (the request waits until vLLM
  aborts it; ``request_finished`` then holds its blocks for the engine's life),
  also when another PP stage's ``retrieve`` answered it (``loads_stuck``);
* when it finishes, its computed whole blocks are stored (store thread); the
  blocks stay with the connector (``request_finished`` -> ``(True, None)``) until
  the agent reports the store complete, or failed, or the agent is gone.

Nothing here ever blocks vLLM for longer than one bounded call, and every agent
failure ends in a miss (recompute), never an error: the agent is a cache. Once
a call failed because the agent is down, nothing calls it (lookups answer 0,
stores are given up and their blocks freed at once) until a probe from its own
thread every ``retrySeconds`` is answered (the client's resilience policy,
:class:`node_agent.client.AgentHealth`, with a probe thread): a ``release`` of
a rid no request has, which the agent answers only once it serves this engine's
stage again (registered, same model).

Under pipeline parallelism (``pp_size > 1``) these calls are stage 0's: each
call made is also recorded as a :class:`~.stage_calls.StageOp`, handed to the
workers in the next step's metadata (:meth:`SchedulerSide.take_stage_ops`), and
the other stages make it on their own agents (:mod:`.stage_calls`). The
admission lookup is then made on a thread of its own, at the same time as the
other stages' (vLLM is answered ``None``, ask again, until it returned), so the
group may be led by any stage's agent. A load is
reported finished only once every other stage reported its ``retrieve`` of the
rid returned (or ``2 x callTimeoutSeconds`` passed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from node_agent.client import (
    AGENT_ERRORS,
    AgentHealth,
    EngineClient,
    RankInfo,
    SlotsInUseError,
    agent_down,
)
from node_agent.integrations.vllm.config import AgentConnectorConfig
from node_agent.integrations.vllm.stage_calls import PROBE_RID, StageOp, block_slots

log = logging.getLogger(__name__)

#: A store whose completion the agent never reports is given up after this long.
STORE_GIVE_UP_SECONDS = 120.0
#: Longest wait of an empty engine step for a load to end (see ``idle_wait``).
IDLE_WAIT_SECONDS = 0.005
#: Poll period of the store thread while stores are in flight.
POLL_SECONDS = 0.005
#: A waiting request's lookup is answered again without a call for this long; then
#: the agent is asked again (it keeps a match for ``unlaunchedMatchSeconds``, 30 s
#: by default).
LOOKUP_REUSE_SECONDS = 20.0
__all__ = ["PROBE_RID", "SchedulerSide", "block_slots"]


@dataclass
class Counters:
    """What the connector did since the last :meth:`SchedulerSide.take_counters`."""

    lookups: int = 0
    hit_tokens: int = 0
    """Tokens lookups found, counted once per request (and again only when its
    tokens changed); ``loaded_tokens`` counts what was actually loaded."""
    loads: int = 0
    loaded_tokens: int = 0
    load_failures: int = 0
    stores: int = 0
    stored_tokens: int = 0
    stores_skipped: int = 0
    """Stores given up without a call: the agent was known to be down."""
    bypassed: int = 0
    """Requests served without the agent: their KV depends on more than the token ids."""
    agent_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class StepReport:
    """What one engine step tells the workers (carried in the connector metadata)."""

    pending: bool = False
    failed: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Lookup:
    tokens: int
    """The request's token count when looked up."""
    local: int
    hit: int
    at: float
    """When the agent answered (monotonic)."""


@dataclass
class _Load:
    rid: str
    blocks: list[int]
    slots: np.ndarray


@dataclass
class _Store:
    rid: str
    tokens: np.ndarray
    slots: np.ndarray
    blocks: tuple[int, ...] = ()
    started: float = 0.0


class SchedulerSide:
    """Data calls and completion bookkeeping of the scheduler-side connector."""

    def __init__(self, cfg: AgentConnectorConfig, block_size: int, tp_size: int,
                 model: str = "", pp_size: int = 1) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.pp_size = pp_size
        rank = RankInfo(replica=cfg.replica, pp_rank=0, pp_size=pp_size, tp_rank=0,
                        tp_size=tp_size, model=model)
        socket = cfg.socket_for(0)
        self.counters = Counters()
        self._probe_client = EngineClient(socket, rank,
                                          timeout=cfg.lookup_timeout_seconds)
        self.health = AgentHealth(cfg.retry_seconds,
                                  probe=lambda: self._probe_client.release(PROBE_RID),
                                  on_failure=lambda: self._count(agent_errors=1), log=log)
        self._lookup_client = EngineClient(socket, rank,
                                           timeout=cfg.lookup_timeout_seconds)
        self._load_client = EngineClient(socket, rank, timeout=cfg.call_timeout_seconds)
        self._store_client = EngineClient(socket, rank,
                                          timeout=cfg.call_timeout_seconds)
        self._lock = threading.Lock()
        self._bypassed: set[str] = set()                # rids served without the agent
        self._lookups: dict[str, _Lookup] = {}          # rid -> its last lookup
        self._no_lookup: set[str] = set()                # a load failed: recompute, no retry
        self._loading: set[str] = set()                  # loads not yet reported
        self._recv_ok: set[str] = set()                  # loaded, to report
        self._recv_failed: dict[str, list[int]] = {}     # failed, blocks to send to workers
        self._recv_failed_sent: set[str] = set()         # blocks sent, rid to report
        self._storing: set[str] = set()
        self._quarantined: set[str] = set()              # loads the agent could not stop
        self._sent: set[str] = set()                     # stores done, to report
        self._stage_ops: list[StageOp] = []              # calls for the other PP stages
        self._awaiting: dict[str, tuple[set[int], float]] = {}  # loads the stages still make
        self._held: set[str] = set()                     # loads ended here, not on every stage
        # PP: lookups on the lookup thread, rid -> (token count, local) asked / answered
        self._lookup_asked: dict[str, tuple[int, int]] = {}
        self._lookup_answers: dict[str, tuple[tuple[int, int], int]] = {}
        self._lookup_jobs: queue.Queue[tuple[str, np.ndarray, int, int] | None] = queue.Queue()
        self._loads: queue.Queue[_Load | None] = queue.Queue()
        self._load_ended = threading.Event()
        self._stores: queue.Queue[_Store | str | None] = queue.Queue()
        self._closing = threading.Event()
        """Set by :meth:`close`: no queued load, store or lookup is started after it."""
        self._threads = [
            threading.Thread(target=self._load_loop, name="flexkv-load", daemon=True),
            threading.Thread(target=self._store_loop, name="flexkv-store", daemon=True),
        ]
        if pp_size > 1:
            self._threads.append(threading.Thread(target=self._lookup_loop,
                                                  name="flexkv-lookup", daemon=True))
        for t in self._threads:
            t.start()

    # -- admission -----------------------------------------------------------

    def bypass(self, rid: str, reason: str) -> None:
        """``rid`` is served without the agent (no lookup, no store, no stage call);
        counted and logged once per request (vLLM asks again at every step while
        the request waits for admission)."""
        with self._lock:
            if rid in self._bypassed:
                return
            self._bypassed.add(rid)
        self._count(bypassed=1)
        log.info("FlexKV connector: request %s served without the agent: its KV depends "
                 "on its %s, not only on its token ids", rid, reason)

    def bypass_ended(self, rid: str) -> None:
        """The bypassed request ``rid`` finished (nothing to store or release)."""
        with self._lock:
            self._bypassed.discard(rid)

    def lookup(self, rid: str, tokens: Sequence[int], local: int) -> int | None:
        """Tokens the agent can load after the ``local`` ones (0 on a miss or any failure).

        vLLM asks again at every step while a request waits for admission: the
        answer of the request's last lookup is given again, without a call, while
        its token count and ``local`` are unchanged and the lookup is younger than
        :data:`LOOKUP_REUSE_SECONDS`; its found tokens are counted once.

        Under PP (``pp_size > 1``) the call is made on the lookup thread while the
        other stages make theirs (whichever stage's agent leads answers at once, the
        others wait for its decision): ``None`` (vLLM asks again at the next step)
        until stage 0's agent answered."""
        bs = self.block_size
        limit = ((len(tokens) - 1) // bs) * bs
        if limit <= local or rid in self._no_lookup:
            return 0
        if not self.health.should_call():
            with self._lock:
                self._lookups.pop(rid, None)  # a restarted agent has lost its match
            return 0
        now = time.monotonic()
        with self._lock:
            prev = self._lookups.get(rid)
        same = prev is not None and prev.tokens == len(tokens) and prev.local == local
        if prev is not None and same and now - prev.at < LOOKUP_REUSE_SECONDS:
            return prev.hit
        ids = np.asarray(tokens, dtype=np.int64)
        if self.pp_size > 1:
            key = (len(tokens), local)
            with self._lock:
                answered = self._lookup_answers.pop(rid, None)
                if answered is None or answered[0] != key:
                    if self._lookup_asked.get(rid) != key:
                        self._lookup_asked[rid] = key
                        self._stage_ops.append(
                            StageOp("lookup", rid, tokens=ids, span=(local, limit)))
                        self._lookup_jobs.put((rid, ids, local, limit))
                    return None
            hit = answered[1]
        else:
            hit = self._call_lookup(rid, ids, local, limit)
        with self._lock:
            self._lookups[rid] = _Lookup(len(tokens), local, hit, now)
        if not same:  # a refresh of an unchanged request finds nothing new
            self._count(hit_tokens=hit)
        return hit

    def _call_lookup(self, rid: str, ids: np.ndarray, local: int, limit: int) -> int:
        """One ``lookup`` call on this stage's agent: the whole blocks found (0 on any
        failure)."""
        mask = np.zeros(len(ids), dtype=bool)
        mask[local:limit] = True
        hit = 0
        try:
            hit = self._lookup_client.lookup(rid, ids, mask)
        except AGENT_ERRORS as exc:
            self.health.failed("lookup", exc)
        except ValueError as exc:
            log.warning("FlexKV lookup refused, treating as a miss: %s", exc)
        else:
            self.health.succeeded()
            self._count(lookups=1)
        hit = max(0, min(int(hit), limit - local))
        return hit - hit % self.block_size

    def _lookup_loop(self) -> None:
        while True:
            job = self._lookup_jobs.get()
            if job is None or self._closing.is_set():
                return
            rid, ids, local, limit = job
            hit = self._call_lookup(rid, ids, local, limit)
            with self._lock:
                asked = self._lookup_asked.get(rid)
                if asked == (len(ids), local):
                    del self._lookup_asked[rid]
                    self._lookup_answers[rid] = ((len(ids), local), hit)
            if asked is None:
                # The request ended (``finished`` forgot it) while this call was
                # queued or running: its release may have reached the agent before
                # the lookup, which then holds a match nobody uses. Release it here,
                # on stage 0's agent only (the other stages' calls ran in order).
                self._release_unmirrored(rid, self._lookup_client)
            self._load_ended.set()

    def after_alloc(self, rid: str, block_ids: Sequence[int], external: int) -> None:
        """Start the load of ``external`` tokens into the request's allocated blocks."""
        with self._lock:
            looked = self._lookups.pop(rid, None)
        if external <= 0:
            if looked is not None and looked.hit > 0:
                self._release(rid, self._lookup_client)  # unlock the unused match now
            return
        bs = self.block_size
        local = looked.local if looked is not None else 0
        first = local // bs
        blocks = list(block_ids[first: first + -(-external // bs)])
        if looked is None or external > looked.hit or local % bs or external % bs:
            # Not what the lookup promised (a vLLM change?): never guess, recompute.
            log.error("FlexKV connector: request %s got %s external tokens after %s local "
                      "ones, not the lookup's %s; recomputing them", rid, external, local,
                      None if looked is None else looked.hit)
            with self._lock:
                self._loading.add(rid)
                self._recv_failed[rid] = blocks
                self._no_lookup.add(rid)
            return
        with self._lock:
            self._loading.add(rid)
            if self.pp_size > 1:
                deadline = time.monotonic() + 2 * self.cfg.call_timeout_seconds
                self._awaiting[rid] = (set(range(1, self.pp_size)), deadline)
        self._mirror(StageOp("retrieve", rid, blocks=tuple(blocks)))
        self._loads.put(_Load(rid, blocks, block_slots(blocks, bs)))

    # -- per step --------------------------------------------------------------

    def step_report(self) -> StepReport:
        """What the workers must echo this step: failed loads' blocks, and whether
        any transfer is pending (then every step carries connector output)."""
        with self._lock:
            failed, self._recv_failed = self._recv_failed, {}
            self._recv_failed_sent.update(failed)
            pending = bool(self._loading or self._recv_ok or self._recv_failed_sent
                           or self._storing or self._sent or self._held or self._stage_ops
                           or self._lookup_asked)
        return StepReport(pending=pending, failed=failed)

    def take_stage_ops(self) -> list[StageOp]:
        """The calls made since the last step, for the other PP stages (in order)."""
        with self._lock:
            ops, self._stage_ops = self._stage_ops, []
        return ops

    def _mirror(self, op: StageOp) -> None:
        if self.pp_size > 1:
            with self._lock:
                self._stage_ops.append(op)

    def idle_wait(self, seconds: float = IDLE_WAIT_SECONDS) -> None:
        """Called once a step that scheduled nothing has run and had nothing to
        report (:meth:`step_output`): while loads are in flight, wait up to
        ``seconds`` for one to end instead of letting vLLM spin empty steps, which
        on a small machine take the CPU the agent's copy needs. Waiting after the
        step rather than before it lets the step's own work overlap the copy, and a
        load ending in the wait is reported by that same step (:meth:`completions`),
        not by the next one."""
        with self._lock:
            waiting = ((bool(self._loading) or bool(self._lookup_asked))
                       and not self._recv_ok and not self._recv_failed)
        if waiting:
            self._load_ended.wait(seconds)
        self._load_ended.clear()

    def step_output(self, failed_echoed: set[str],
                    loads_ended: Iterable[tuple[int, str]] = (), empty: bool = False,
                    loads_stuck: Iterable[tuple[int, str]] = (),
                    ) -> tuple[set[str], set[str]]:
        """``(finished_recving, finished_sending)`` of a step that ran, its worker
        report (``failed_echoed``, ``loads_ended``, ``loads_stuck``, as for
        :meth:`completions`) in
        hand. A step that scheduled nothing (``empty``) and has nothing to report
        waits (:meth:`idle_wait`) for a load to end, then reports what ended in the
        wait. It never waits when its own worker report completes a load (a failed
        load's blocks echoed, the last PP stage's ``retrieve`` ended): that load is
        reported at once."""
        recv, sent = self.completions(failed_echoed, loads_ended, loads_stuck)
        if empty and not recv and not sent:
            self.idle_wait()
            recv, sent = self.completions(set())
        return recv, sent

    def completions(self, failed_echoed: set[str],
                    loads_ended: Iterable[tuple[int, str]] = (),
                    loads_stuck: Iterable[tuple[int, str]] = (),
                    ) -> tuple[set[str], set[str]]:
        """``(finished_recving, finished_sending)`` to add to this step's output.
        ``failed_echoed``: failed loads whose blocks the workers reported invalid;
        ``loads_ended``: ``(pp_rank, rid)`` of the other PP stages' ``retrieve``
        calls that returned. A load ended here is held until every stage ended it.
        ``loads_stuck``: those of them answered ``SlotsInUse`` (that stage's copy may
        still write the blocks): the load is quarantined like one stage 0's agent
        could not stop, never reported (:meth:`_quarantine`)."""
        now = time.monotonic()
        stuck = {rid for _, rid in loads_stuck}
        with self._lock:
            for rid in stuck:
                self._quarantine_locked(rid)
            for pp_rank, rid in loads_ended:
                waiting = self._awaiting.get(rid)
                if waiting is not None:
                    waiting[0].discard(pp_rank)
            recv = self._recv_ok | self._held
            self._recv_ok = set()
            echoed = failed_echoed & self._recv_failed_sent
            self._recv_failed_sent -= echoed
            recv |= echoed
            recv -= self._quarantined
            self._held = set()
            for rid in list(recv):
                waiting = self._awaiting.get(rid)
                if waiting is None:
                    continue
                if waiting[0] and now < waiting[1]:
                    self._held.add(rid)
                    recv.discard(rid)
                    continue
                if waiting[0]:
                    log.warning("FlexKV load of %s: PP stages %s did not report their "
                                "retrieve ended in time, reporting the load finished", rid,
                                sorted(waiting[0]))
                del self._awaiting[rid]
            self._loading -= recv
            sent, self._sent = self._sent, set()
        return recv, sent

    # -- request end -------------------------------------------------------------

    def finished(self, rid: str, tokens: Sequence[int], computed: int,
                 block_ids: Sequence[int]) -> bool:
        """Store the request's computed whole blocks; True while the store holds them."""
        with self._lock:
            self._lookups.pop(rid, None)
            self._lookup_asked.pop(rid, None)
            self._lookup_answers.pop(rid, None)
            busy = rid in self._loading
            self._no_lookup.discard(rid)
            quarantined = rid in self._quarantined
        if quarantined:
            return True  # never reported: the agent's copy may still write its blocks
        if busy:
            self._stores.put(rid)  # release (cancels the load if it has not started)
            return False  # its blocks are held by the load until it is reported
        n_blocks = min(computed, len(tokens), len(block_ids) * self.block_size) // self.block_size
        if n_blocks == 0 or not self.health.should_call():
            self._stores.put(rid)  # release: the agent forgets the request
            return False
        n = n_blocks * self.block_size
        with self._lock:
            self._storing.add(rid)
        self._stores.put(_Store(rid, np.asarray(tokens[:n], dtype=np.int64),
                                block_slots(block_ids[:n_blocks], self.block_size),
                                blocks=tuple(block_ids[:n_blocks])))
        return True

    # -- threads -----------------------------------------------------------------

    def _load_loop(self) -> None:
        while True:
            job = self._loads.get()
            if job is None or self._closing.is_set():
                return
            ok = False
            try:
                loaded = self._load_client.retrieve(job.rid, job.slots)
                ok = loaded == len(job.slots)
                self.health.succeeded()
            except SlotsInUseError as exc:
                self._quarantine(job, exc)
                continue
            except AGENT_ERRORS as exc:
                self.health.failed("retrieve", exc)
            except Exception as exc:
                log.warning("FlexKV load of %s failed, recomputing: %s", job.rid, exc)
            with self._lock:
                if job.rid in self._quarantined:
                    pass  # another PP stage's copy may still write its blocks
                elif ok:
                    self._recv_ok.add(job.rid)
                else:
                    self._recv_failed[job.rid] = job.blocks
                    self._no_lookup.add(job.rid)
            self._load_ended.set()
            if ok:
                self._count(loads=1)
                self._count(loaded_tokens=len(job.slots))
            else:
                self._count(load_failures=1)

    def _quarantine(self, job: _Load, exc: SlotsInUseError) -> None:
        """The agent's copy of ``job`` did not stop and may still write its blocks:
        they must never be recomputed into nor given to another request. The load
        is never reported (the request waits until vLLM aborts it) and
        :meth:`finished` holds its blocks for the engine's life."""
        log.error("FlexKV load of %s could not be stopped by the agent; its %s blocks "
                  "are kept out of use for the engine's life: %s", job.rid,
                  len(job.blocks), exc)
        with self._lock:
            self._quarantine_locked(job.rid)
        self._count(load_failures=1)
        self._load_ended.set()

    def _quarantine_locked(self, rid: str) -> None:
        """Never report ``rid``'s load nor send its blocks back (``_lock`` held):
        a stage's copy may still write them. Its blocks are held from
        :meth:`finished` on, for the engine's life."""
        self._quarantined.add(rid)
        self._loading.discard(rid)
        self._awaiting.pop(rid, None)
        self._recv_ok.discard(rid)
        self._held.discard(rid)
        self._recv_failed.pop(rid, None)
        self._recv_failed_sent.discard(rid)

    def _store_loop(self) -> None:
        inflight: dict[str, _Store] = {}
        while True:
            try:
                job = self._stores.get(timeout=POLL_SECONDS if inflight else None)
            except queue.Empty:
                job = ""
            if job is None or self._closing.is_set():
                return
            if isinstance(job, _Store):
                self._start_store(job, inflight)
            elif job:
                self._release(job)
            if inflight:
                self._poll(inflight)

    def _start_store(self, job: _Store, inflight: dict[str, _Store]) -> None:
        if not self.health.should_call():
            # Known down (a call failed): give the store up now, freeing its blocks,
            # rather than wait out another call timeout per queued store.
            self._count(stores_skipped=1)
            self._store_done(job.rid)
            return
        task = -1
        self._mirror(StageOp("store", job.rid, tokens=job.tokens, blocks=job.blocks))
        try:
            task = self._store_client.store_kv(job.rid, job.tokens, job.slots)
            self.health.succeeded()
        except AGENT_ERRORS as exc:
            self.health.failed("store_kv", exc)
        except Exception as exc:
            log.warning("FlexKV store of %s refused: %s", job.rid, exc)
        if task >= 0:
            job.started = time.monotonic()
            inflight[job.rid] = job
            self._count(stores=1)
            self._count(stored_tokens=len(job.tokens))
        else:
            self._store_done(job.rid)

    def _poll(self, inflight: dict[str, _Store]) -> None:
        try:
            done = set(self._store_client.poll_completed())
        except AGENT_ERRORS as exc:
            self.health.failed("poll_completed", exc)
            # Gone or restarted, the agent no longer reads any source slot.
            done = set(inflight) if agent_down(exc) else set()
        now = time.monotonic()
        for rid, job in list(inflight.items()):
            if rid in done or now - job.started > STORE_GIVE_UP_SECONDS:
                if rid not in done:
                    log.warning("FlexKV store of %s not reported complete in %ss, freeing "
                                "its blocks", rid, STORE_GIVE_UP_SECONDS)
                del inflight[rid]
                self._store_done(rid)

    def _store_done(self, rid: str) -> None:
        with self._lock:
            self._storing.discard(rid)
            self._sent.add(rid)
        self._release(rid)

    def _release(self, rid: str, client: EngineClient | None = None) -> None:
        if not self.health.should_call():
            return
        self._mirror(StageOp("release", rid))
        self._release_unmirrored(rid, client)

    def _release_unmirrored(self, rid: str, client: EngineClient | None = None) -> None:
        """Release ``rid`` on stage 0's agent only (no op for the other stages)."""
        if not self.health.should_call():
            return
        try:
            # In the scheduler's step: no answer to wait for where the agent
            # handles releases in order (a single-stage group).
            (client or self._store_client).release_nowait(rid)
        except AGENT_ERRORS as exc:
            if agent_down(exc):
                self.health.failed("release", exc)
        except Exception as exc:
            log.debug("FlexKV release of %s failed: %s", rid, exc)

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for key, n in amounts.items():
                setattr(self.counters, key, getattr(self.counters, key) + n)

    def take_counters(self) -> dict[str, int]:
        """Counters since the last call (for vLLM's connector stats)."""
        with self._lock:
            out = self.counters.as_dict()
            for k in out:
                setattr(self.counters, k, 0)
        return out

    def close(self) -> None:
        """Stop the threads (bounded by the call each one is making) and close the
        sockets. Queued loads, stores, releases and lookups are dropped, never made:
        vLLM shuts its workers down (freeing their KV caches) before it shuts the
        scheduler's connector down, so a load or store started now would write or
        read memory the engine no longer owns (a store would publish whatever it
        read as the prompt's KV). A call already in flight still ends; the agent
        forgets the dropped rids' matches after ``unlaunchedMatchSeconds``."""
        self._closing.set()
        for q in (self._loads, self._stores, self._lookup_jobs):
            with q.mutex:
                q.queue.clear()
            q.put(None)
        self.health.close()
        for t in self._threads:
            t.join(timeout=self.cfg.call_timeout_seconds)
        for c in (self._lookup_client, self._load_client, self._store_client,
                  self._probe_client):
            c.close()

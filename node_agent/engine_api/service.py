"""Maps engine API requests onto this agent's PP stages.

A *stage* is one member of one PP group on this node: ``(replica, ppRank)``. It
is created when the first engine rank of that stage registers (the layout comes
from the engine, as in FlexKV, and sizes the tiers) and owns the stage's
connector, which owns the backend (:class:`StageFactory` builds it, started).
Every TP rank of the stage registers its own buffers into the same stage.

Contract of the operations (``rank`` identifies the calling engine rank):

* ``register`` opens the buffer handles (:func:`.buffers.open_buffer`) and hands
  the tensors to the connector. Re-registering a rank (engine restart) swaps its
  buffers; cached blocks stay. A layout that disagrees with the stage's, or a
  ``tokensPerBlock`` other than the pool's, is refused with ``ValueError``. A rank
  whose model digest (``rank.model``, :mod:`.identity`) differs from the stage's
  replaces the stage: a fresh one, whose blocks are keyed by the new model.
* every other call whose ``rank.model`` differs from its stage's is refused with
  ``NotReady`` (an engine of another model registered the replica since).
* ``lookup`` / ``retrieve`` / ``store_kv`` / ``release`` / ``poll_completed`` go to
  the stage's connector unchanged. They come from TP rank 0 only: one call moves
  the KV of every TP rank of the stage (other ranks get ``ValueError``). A rank
  that has not registered gets ``NotReady`` (the client re-registers and retries
  once).
* ``wait_completed`` waits inside the agent on the connector's completion
  condition until a rid is reportable or ``timeoutMs`` (at most ``MAX_WAIT_MS``)
  passes: the engine's completion notification, without a socket round trip or
  a poll loop.
* ``ping`` and ``status`` answer without touching a stage.

:meth:`EngineService.inline` tells the server which calls its I/O thread may
answer itself: those a stage lists in ``Stage.inline_ops`` (a single-stage
group on the embedded backend without a remote tier lists ``lookup``,
``store_kv``, ``release`` and ``poll_completed``, which wait on no peer, copy,
timer or network: a store only launches its copy; with an SSD tier ``store_kv``
is left out, because a store that evicts writes the spilled blocks to disk).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from node_agent.engine_api import protocol
from node_agent.engine_api.buffers import OpenedBuffer, open_buffer
from node_agent.engine_api.identity import check_digest
from node_agent.engine_api.protocol import layout_to_wire, parse_layout
from node_agent.engine_api.server import NotReadyError, Parked
from node_agent.metrics import AgentMetrics
from node_agent.vocab.layout import KVLayout

log = logging.getLogger(__name__)

class Coordinator(Protocol):
    """The connector API the agent drives (one per stage)."""

    def register_kv_buffers(self, rank: int, buffers: Sequence[Sequence[Any]]) -> None: ...
    def store_kv(self, rid: str, token_ids: Any, kv_indices: Any) -> int: ...
    def lookup(self, rid: str, token_ids: Any, token_mask: Any = None) -> int: ...
    def retrieve(self, rid: str, slot_mapping: Any) -> int: ...
    def claim_load(self, rid: str) -> tuple[int, list[int], dict[str, Any], int] | None: ...
    def claim_fence(self, rid: str, claim: int) -> int | None: ...
    def commit_load(self, rid: str, claim: int) -> bool: ...
    def tier_handle(self) -> dict[str, Any] | None: ...
    def release(self, rid: str) -> None: ...
    def poll_completed(self) -> list[str]: ...
    def wait_completed(self, timeout: float) -> list[str]: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def ready(self) -> bool: ...
    def tier_bytes(self) -> dict[str, tuple[int, int]] | None:
        """Tier name -> (capacity, used) bytes of the stage's backend while the stage
        leads its group; None otherwise."""
    def recovered_blocks(self) -> int | None:
        """SSD blocks the stage's backend recovered at its start, while the stage
        leads its group; None otherwise."""
    def lookup_totals(self) -> tuple[int, int, int] | None:
        """(source, tokens looked up, tokens hit) since the stage's backend started
        (``source`` names that backend instance), while the stage leads its group
        and its backend counts them; None otherwise."""
    def peek(self, tokens: Any) -> dict[str, int] | None:
        """Cached tokens of the prefix of ``tokens`` by local tier, read-only, while
        the stage leads its group and its backend can answer so; None otherwise."""


def wait_completed(conn: Coordinator, timeout_ms: int) -> list[str]:
    """The connector's ``wait_completed``: rids reported as soon as one becomes
    reportable (the connector's roles notify it; no polling), or ``[]`` after
    ``timeout_ms``. Raises ``ValueError`` for a timeout outside ``0..MAX_WAIT_MS``."""
    if not 0 <= timeout_ms <= protocol.MAX_WAIT_MS:
        raise ValueError(f"wait_completed: timeoutMs {timeout_ms} is not in "
                         f"0..{protocol.MAX_WAIT_MS}; wait longer by calling again")
    return [str(r) for r in conn.wait_completed(timeout_ms / 1000)]


INLINE_CANDIDATES = frozenset({"lookup", "store_kv", "release", "poll_completed",
                               "lookup_claim", "claim_load", "commit_load", "tier"})
"""Operations a stage may let the I/O thread answer (:attr:`Stage.inline_ops`)."""


@dataclass(frozen=True)
class StageKey:
    """A PP stage on this node."""

    replica: str
    pp_rank: int


@dataclass(frozen=True)
class RankRef:
    """An engine rank as the wire names it."""

    replica: str
    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    model: str = ""
    """The digest of the engine's model identity (``identity.ModelIdentity``); ``""``
    when the engine sent none."""

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> RankRef:
        """Validate the wire ``rank`` object; ``ValueError`` names the bad field."""
        replica = raw.get("replica")
        if not isinstance(replica, str) or not replica or len(replica) > 253:
            raise ValueError(f"rank.replica {replica!r} must be a non-empty string "
                             "(the engine replica's name)")
        vals: dict[str, int] = {}
        for key, lo in (("ppRank", 0), ("ppSize", 1), ("tpRank", 0), ("tpSize", 1)):
            v = raw.get(key, 0 if key.endswith("Rank") else 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo or v > 4096:
                raise ValueError(f"rank.{key} {v!r} must be an int >= {lo}")
            vals[key] = v
        if vals["ppRank"] >= vals["ppSize"] or vals["tpRank"] >= vals["tpSize"]:
            raise ValueError(f"rank {dict(raw)!r}: ppRank < ppSize and tpRank < tpSize must hold")
        model = check_digest("rank.model", raw.get("model", ""))
        return cls(replica, vals["ppRank"], vals["ppSize"], vals["tpRank"], vals["tpSize"],
                   model)

    @property
    def stage(self) -> StageKey:
        return StageKey(self.replica, self.pp_rank)


class StageTraffic:
    """The engine traffic of one stage: calls by operation, tokens looked up and
    hit (``/status``), mirrored into the per-replica metrics when given. Thread-safe."""

    def __init__(self, replica: str, metrics: AgentMetrics | None = None) -> None:
        self._lock = threading.Lock()
        self._replica = replica
        self._metrics = metrics
        self.calls: dict[str, int] = {}
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self._looked = None if metrics is None else metrics.replica_lookup_tokens.labels(
            replica=replica)
        self._hit = None if metrics is None else metrics.replica_hit_tokens.labels(
            replica=replica)
        self._op_counters: dict[str, Any] = {}

    def call(self, op: str) -> None:
        """Count one call of ``op``."""
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            counter = self._op_counters.get(op)
            if counter is None and self._metrics is not None:
                counter = self._metrics.replica_requests.labels(replica=self._replica, op=op)
                self._op_counters[op] = counter
        if counter is not None:
            counter.inc()

    def lookup(self, looked: int, hit: int) -> None:
        """Count a lookup of ``looked`` tokens of which ``hit`` were found."""
        with self._lock:
            self.lookup_tokens += looked
            self.hit_tokens += hit
        if self._looked is not None and self._hit is not None:
            self._looked.inc(looked)
            self._hit.inc(hit)

    def to_json(self) -> dict[str, Any]:
        """``/status``'s ``traffic`` of the stage."""
        with self._lock:
            return {"calls": dict(sorted(self.calls.items())),
                    "lookupTokens": self.lookup_tokens, "hitTokens": self.hit_tokens}


def _lookup(conn: Coordinator, traffic: StageTraffic | None, req: protocol.Request) -> int:
    """A ``lookup`` (or ``lookup_claim``'s lookup) of ``req``, counted in the
    stage's traffic."""
    a = req.arrays
    hit = int(conn.lookup(req.args["rid"], a["token_ids"], a.get("token_mask")))
    if traffic is not None:
        traffic.lookup(len(a["token_ids"]), hit)
    return hit


def _fence(stage: Stage, rid: str, claim: int) -> int | None:
    """The claim fence a claim reply hands out (docs/agent.md, "Engine-side
    loads"), only where ``commit_load`` is answered on the I/O thread: there an
    engine's commit sent without waiting is handled before its next call (a
    ``release`` of the rid never overtakes it) and is never refused as busy."""
    if "commit_load" not in stage.inline_ops:
        return None
    return stage.coordinator.claim_fence(rid, claim)


@dataclass
class Stage:
    """One PP stage's connector, its group-view handle and the engine buffers it maps."""

    key: StageKey
    pp_size: int
    group: str
    layout: KVLayout
    coordinator: Coordinator
    views: Any = None
    """The stage's group-view source (``node_agent.pp.group.GroupViewSource``)."""
    buffers: dict[int, list[OpenedBuffer]] = field(default_factory=dict)
    """tp rank -> the opened handles (kept open while registered)."""
    registrations: int = 0
    last_call: float = field(default_factory=time.monotonic)
    """When an engine rank of this stage last called (monotonic clock)."""
    model: str = ""
    """The model digest of the ranks that registered this stage: calls of any
    other model are refused, and a registration of another model replaces the
    stage (its blocks are never seen by the other model)."""
    inline_ops: frozenset[str] = frozenset()
    """Operations of this stage that never wait on a peer, a copy or a timer
    (a single-stage group's ``lookup``, ``store_kv``, ``release``,
    ``poll_completed`` on the embedded backend without a remote tier; a store
    launches its copy and returns, and is left out with an SSD tier, where it
    may spill to disk): the engine socket's I/O thread answers them itself,
    without the two thread hops of a worker call (see :meth:`EngineService.inline`)."""
    traffic: StageTraffic | None = None
    """The stage's engine traffic (set by :class:`EngineService` when it adds the stage)."""
    cache_epoch: int = 0
    """The cache epoch the stage was built under: a flush that lands while the stage
    is built (before it is in ``EngineService.stages``) is applied to it when it is
    added (``Agent.attach_stage``)."""
    shared: Any = None
    """The stage's view of a backend it shares with other replicas of its model
    (``node_agent.backend.shared.SharedStageBackend``); None: a backend of its own."""
    backend_key: Hashable = None
    """Which backend (and so which tier share) the stage uses: stages with one key
    share one backend (set by :class:`EngineService` when it adds the stage)."""

    def close(self) -> None:
        """Close the connector (and with it the backend), then unmap the buffers."""
        try:
            self.coordinator.close()
        finally:
            for opened in self.buffers.values():
                for b in opened:
                    b.close()
            self.buffers.clear()


class StageFactory(Protocol):
    """Builds the started connector of a new stage (raises ``ValueError`` naming
    what is missing, e.g. the Curve keys of a multi-stage group)."""

    def __call__(self, rank: RankRef, layout: KVLayout) -> Stage: ...


class EngineService:
    """The engine API's request handler (thread-safe; called from the server's pool)."""

    def __init__(self, factory: StageFactory, tokens_per_block: int,
                 status: Callable[[], dict[str, Any]] | None = None,
                 max_stages: int = 1, stale_after: float = 15.0,
                 on_stage: Callable[[Stage], None] | None = None,
                 metrics: AgentMetrics | None = None, tier_shares: int | None = None,
                 backend_of: Callable[[RankRef, KVLayout], Hashable] | None = None,
                 call_seconds: float | None = None) -> None:
        """``call_seconds``: when the engine socket answers a call at the latest
        (``engineCallSeconds`` plus margin), sent in every ``register`` reply so that
        a client whose own timeout is not above it refuses to run (None: not sent).
        ``max_stages``: stages served at once (a further one is refused unless one
        was idle for ``stale_after`` seconds); ``metrics``: where each replica's
        traffic is counted (``flexkv_agent_replica_*``). ``tier_shares``: backends
        served at once, each on one share of the tiers (None: ``max_stages``);
        ``backend_of(rank, layout)`` names the backend a new stage would use
        (None: each stage its own), so a stage that would need a backend beyond
        ``tier_shares`` is refused unless retiring an idle stage frees a share."""
        self._factory = factory
        self._metrics = metrics
        self._on_stage = on_stage
        self._tpb = tokens_per_block
        self._status = status
        self._max_stages = max_stages
        self._tier_shares = max_stages if tier_shares is None else tier_shares
        self._backend_of = backend_of
        self._stale_after = stale_after
        self._lock = threading.Lock()
        self.stages: dict[StageKey, Stage] = {}
        self.call_seconds = call_seconds
        self.completion_wake: Callable[[], None] | None = None
        """Wakes the engine socket's I/O thread to answer parked ``wait_completed``
        calls (the server's ``wake``; set by the agent). None: nothing is parked."""

    def __call__(self, req: protocol.Request) -> Any:
        if req.op == "ping":
            return {"version": protocol.VERSION, "ready": self.ranks_registered() > 0}
        if req.op == "status":
            return self._status() if self._status else {}
        rank = RankRef.parse(req.args["rank"])
        if req.op == "register":
            return self.register(rank, req.args["layout"], req.args["buffers"])
        stage = self._stage_of(rank)
        conn = stage.coordinator
        if rank.tp_rank != 0:
            raise ValueError(
                f"{req.op} from TP rank {rank.tp_rank}: with tensor parallelism only TP rank 0 "
                "calls lookup/retrieve/store_kv/poll_completed/release (the agent moves every "
                "TP rank's KV in one operation); other ranks only register their buffers"
            )
        a = req.arrays
        traffic = stage.traffic
        if traffic is not None:
            traffic.call(req.op)
        if req.op == "lookup":
            return _lookup(conn, traffic, req)
        if req.op == "retrieve":
            return int(conn.retrieve(req.args["rid"], a["slot_mapping"]))
        if req.op == "lookup_claim":
            # lookup, then claim_load in the same call (one round trip less)
            hit = _lookup(conn, traffic, req)
            got = conn.claim_load(req.args["rid"]) if hit else (0, [], {}, -1)
            if got is None:  # the lookup stays open for retrieve
                return {"hit": hit, "blocks": None, "tier": conn.tier_handle(), "claim": -1}
            # A miss names the stage's tier as well, so an engine always knows it.
            fence = _fence(stage, req.args["rid"], got[3]) if got[1] else None
            return {"hit": got[0], "blocks": got[1], "tier": got[2] or conn.tier_handle(),
                    "claim": got[3], "fence": fence}
        if req.op == "tier":
            return conn.tier_handle()
        if req.op == "claim_load":
            got = conn.claim_load(req.args["rid"])
            if got is None:
                return None
            hit, blocks, tier, claim = got
            return {"hit": hit, "blocks": blocks, "tier": tier, "claim": claim,
                    "fence": _fence(stage, req.args["rid"], claim) if blocks else None}
        if req.op == "commit_load":
            return bool(conn.commit_load(req.args["rid"], req.args["claim"]))
        if req.op == "store_kv":
            return int(conn.store_kv(req.args["rid"], a["token_ids"], a["kv_indices"]))
        if req.op == "poll_completed":
            return [str(r) for r in conn.poll_completed()]
        if req.op == "wait_completed":
            return wait_completed(conn, req.args["timeoutMs"])
        if req.op == "release":
            conn.release(req.args["rid"])
            return None
        raise protocol.ProtocolError(f"op {req.op!r} has no handler")  # schema and code disagree

    def inline(self, req: protocol.Request) -> bool:
        """True when ``req`` may run on the engine socket's I/O thread: its stage
        lists the op in :attr:`Stage.inline_ops` (calls that wait only for the
        stage's own short locks). Anything else, or a rank this cannot read
        cheaply, goes to a worker (where ``__call__`` checks it in full)."""
        if req.op not in INLINE_CANDIDATES:
            return False
        raw = req.args.get("rank")
        if not isinstance(raw, dict):
            return False
        replica, pp_rank = raw.get("replica"), raw.get("ppRank", 0)
        if not isinstance(replica, str) or type(pp_rank) is not int:
            return False
        stage = self.stages.get(StageKey(replica, pp_rank))
        return stage is not None and req.op in stage.inline_ops

    def park(self, req: protocol.Request) -> Parked | None:
        """How the engine socket's I/O thread answers ``req`` without a worker,
        or None (a worker serves it): a ``wait_completed`` of a stage whose
        ``poll_completed`` is inline (it takes no lock a copy or a peer holds)
        is parked there and answered with the rids once the stage's
        coordinator reports some (its completion hook wakes the I/O thread),
        or ``[]`` after ``timeoutMs``, like the worker's wait. Anything this
        cannot accept cheaply (a bad rank, timeout or stage) goes to a worker,
        where ``__call__`` raises the error."""
        wake = self.completion_wake
        if req.op != "wait_completed" or wake is None:
            return None
        timeout_ms = req.args.get("timeoutMs")
        if type(timeout_ms) is not int or not 0 <= timeout_ms <= protocol.MAX_WAIT_MS:
            return None
        try:
            rank = RankRef.parse(req.args["rank"])
            stage = self._stage_of(rank)
        except Exception:  # must not raise: the worker path names the error
            return None
        if rank.tp_rank != 0 or "poll_completed" not in stage.inline_ops:
            return None
        conn = stage.coordinator
        hook = getattr(conn, "set_completion_hook", None)
        if hook is None:
            return None
        hook(wake)
        if stage.traffic is not None:
            stage.traffic.call(req.op)

        def poll() -> list[str] | None:
            return [str(r) for r in conn.poll_completed()] or None

        return Parked(poll, timeout_ms / 1000, [])

    def _stage_of(self, rank: RankRef) -> Stage:
        stage = self.stages.get(rank.stage)
        if stage is None or rank.tp_rank not in stage.buffers:
            raise NotReadyError(
                f"rank {rank.replica}/pp{rank.pp_rank}/tp{rank.tp_rank} has not registered its "
                "KV buffers with this agent; call register_kv_buffers first"
            )
        if rank.model != stage.model:
            raise NotReadyError(
                f"stage {rank.replica}/pp{rank.pp_rank} serves model {stage.model or '(none)'} "
                f"but this call is from model {rank.model or '(none)'}: an engine of another "
                "model registered this replica since; give each model its own replica name, "
                "or restart this engine so that it registers again"
            )
        stage.last_call = time.monotonic()
        return stage

    def register(self, rank: RankRef, layout_raw: Mapping[str, Any],
                 handles: Sequence[Any]) -> dict[str, Any]:
        """Open ``handles`` (a list of lists, as the layout names) and register them."""
        layout = parse_layout(layout_raw)
        if layout.tokens_per_block != self._tpb:
            raise ValueError(
                f"layout tokensPerBlock {layout.tokens_per_block} differs from the pool's "
                f"tokensPerBlock {self._tpb}; set the engine's page size to {self._tpb} or "
                "change the pool"
            )
        if layout.tp_size != rank.tp_size:
            raise ValueError(f"layout tpSize {layout.tp_size} differs from rank.tpSize "
                             f"{rank.tp_size}; send the same TP size in both")
        if not isinstance(handles, list) or not all(isinstance(g, list) for g in handles):
            raise ValueError("buffers must be a list of lists of handles, arranged as the "
                             "layout names them (e.g. [k_buffers, v_buffers])")
        opened: list[OpenedBuffer] = []
        try:
            nested = []
            for group in handles:
                row = []
                for h in group:
                    b = open_buffer(h)
                    opened.append(b)
                    row.append(b.tensor)
                nested.append(row)
            with self._lock:
                stage = self._stage_for(rank, layout)
                stage.coordinator.register_kv_buffers(rank.tp_rank, nested)
                old = stage.buffers.get(rank.tp_rank, [])
                stage.buffers[rank.tp_rank] = opened
                stage.registrations += 1
                stage.last_call = time.monotonic()
        except BaseException:
            for b in opened:
                b.close()
            raise
        for b in old:
            b.close()
        log.info("Engine rank registered", extra={
            "replica": rank.replica, "pp_rank": rank.pp_rank, "tp_rank": rank.tp_rank,
            "buffers": len(opened), "again": stage.registrations > 1})
        reply: dict[str, Any] = {"stage": f"{rank.replica}/pp{rank.pp_rank}",
                                 "registrations": stage.registrations,
                                 "tokensPerBlock": layout.tokens_per_block,
                                 # Answered in arrival order on the I/O thread: an
                                 # engine may send these without waiting.
                                 "inOrder": sorted(stage.inline_ops)}
        if self.call_seconds is not None:
            reply["callSeconds"] = self.call_seconds
        return reply

    def _stage_for(self, rank: RankRef, layout: KVLayout) -> Stage:
        stage = self.stages.get(rank.stage)
        if stage is not None and stage.model != rank.model:
            # Another model (a fine-tune, new weights under one name) on this replica:
            # a fresh stage, so that none of the old model's blocks can be loaded.
            del self.stages[rank.stage]
            log.warning("Stage replaced by an engine of another model", extra={
                "replica": rank.replica, "pp_rank": rank.pp_rank,
                "old_model": stage.model, "new_model": rank.model})
            stage.close()
            stage = None
        if stage is not None and not stage.buffers and (
                stage.layout != layout or stage.pp_size != rank.pp_size):
            # Nothing registered into it yet: a corrected first registration rebuilds it.
            del self.stages[rank.stage]
            stage.close()
            stage = None
        if stage is not None:
            if stage.layout != layout or stage.pp_size != rank.pp_size:
                raise ValueError(
                    f"stage {rank.replica}/pp{rank.pp_rank} was registered with layout "
                    f"{layout_to_wire(stage.layout)} and ppSize {stage.pp_size}; this rank sent "
                    f"{layout_to_wire(layout)} and ppSize {rank.pp_size}: every rank of a stage "
                    "must send the same layout"
                )
            return stage
        if len(self.stages) >= self._max_stages:
            self._retire_idle_stage()
        if len(self.stages) >= self._max_stages:
            raise ValueError(
                f"this agent already serves {len(self.stages)} stage(s) "
                f"({', '.join(f'{k.replica}/pp{k.pp_rank}' for k in self.stages)}), as many "
                f"as its maxStages ({self._max_stages}): raise maxStages in the agent's "
                "config (tierShares, absent: maxStages, splits the tier sizes among the backends), "
                "or run the other "
                f"replica's ranks on another node (a stage idle for {self._stale_after:g}s "
                "is replaced)"
            )
        key = self._backend_of(rank, layout) if self._backend_of is not None else rank.stage
        if not self._share_free(key):
            self._retire_idle_backend()
        if not self._share_free(key):
            held = sorted(f"{k.replica}/pp{k.pp_rank}" for k in self.stages)
            raise ValueError(
                f"stage {rank.replica}/pp{rank.pp_rank} needs a backend of its own (another "
                f"model, layout or PP group than the stages served), but all tierShares "
                f"({self._tier_shares}) shares of the agent's tiers are held by the backends "
                f"of {', '.join(held)} (maxStages {self._max_stages}): raise tierShares "
                f"(at most maxStages; each backend gets 1/tierShares of the tier sizes) in "
                "the pool or the agent's config, or run this replica on another node (a "
                f"stage idle for {self._stale_after:g}s is replaced)"
            )
        stage = self._factory(rank, layout)
        stage.traffic = StageTraffic(rank.replica, self._metrics)
        stage.backend_key = key
        self.stages[rank.stage] = stage
        if self._on_stage is not None:
            # After insertion: a group-view update racing with this registration
            # either sees the stage or is read here (see Agent.attach_stage).
            self._on_stage(stage)
        return stage

    def _share_free(self, key: Hashable) -> bool:
        """Whether a stage on backend ``key`` fits: that backend is in use already,
        or fewer than ``tier_shares`` backends are."""
        held = {s.backend_key for s in self.stages.values()}
        return key in held or len(held) < self._tier_shares

    def _retire_idle_backend(self) -> None:
        """Free a tier share: close every stage of the backend whose engines called
        last longest ago, if none of them called for ``stale_after`` seconds (its
        replicas are gone, so a stage of another backend may register)."""
        last: dict[Hashable, float] = {}
        for stage in self.stages.values():
            last[stage.backend_key] = max(last.get(stage.backend_key, 0.0), stage.last_call)
        if not last:
            return
        backend, newest = min(last.items(), key=lambda kv: kv[1])
        if time.monotonic() - newest < self._stale_after:
            return
        for key, stage in list(self.stages.items()):
            if stage.backend_key != backend:
                continue
            del self.stages[key]
            log.warning("Idle stage replaced by a new registration", extra={
                "replica": key.replica, "pp_rank": key.pp_rank,
                "idle_seconds": round(time.monotonic() - stage.last_call, 1)})
            stage.close()

    def _retire_idle_stage(self) -> None:
        """Close the longest-idle stage if no engine called it for ``stale_after``
        seconds: its engines are gone (a replica moved), so a new one may register."""
        if not self.stages:
            return
        key, stage = min(self.stages.items(), key=lambda kv: kv[1].last_call)
        idle = time.monotonic() - stage.last_call
        if idle < self._stale_after:
            return
        del self.stages[key]
        log.warning("Idle stage replaced by a new registration", extra={
            "replica": key.replica, "pp_rank": key.pp_rank, "idle_seconds": round(idle, 1)})
        stage.close()

    # -- views for readiness, status and the heartbeat ------------------------

    def ranks_registered(self) -> int:
        """Engine ranks with buffers registered, over all stages."""
        return sum(len(s.buffers) for s in list(self.stages.values()))

    def memberships(self) -> list[dict[str, Any]]:
        """The Lease's ``flexkv.io/memberships`` entries."""
        return [{"replica": k.replica, "ppRank": k.pp_rank, "ppSize": s.pp_size}
                for k, s in sorted(self.stages.items(), key=lambda kv: (kv[0].replica,
                                                                        kv[0].pp_rank))]

    def close(self) -> None:
        """Close every stage (connectors first, then backends, then buffer mappings)."""
        with self._lock:
            stages, self.stages = list(self.stages.values()), {}
        for s in stages:
            try:
                s.close()
            except Exception:
                log.exception("Stage did not close cleanly", extra={"stage": str(s.key)})

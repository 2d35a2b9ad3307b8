"""Test harness: engine-like KV buffers with per-stage deterministic content,
connector construction, and a stage process driven over a multiprocessing pipe.

Content model: the KV of token i of a prompt depends on the whole prefix
``tokens[:i + 1]`` (as real KV does) and on the stage, plane and element, so a
write into a wrong slot, a wrong stage's bytes or a stale block is visible as
a value mismatch. Values are small integers, exact in float32.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.stage_store import TierStore
from node_agent.coordinator import Coordinator, CoordinatorConfig
from node_agent.coordinator.follower import FollowerRole
from node_agent.metrics import AgentMetrics
from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import FanoutServer, FaultPlan
from node_agent.pp.group import GroupViewSource
from node_agent.pp.messages import Envelope, Message, Op, decode, is_batch, unpack_batch
from node_agent.pp.stream import StreamMetrics
from node_agent.vocab.group_view import GroupView
from node_agent.vocab.layout import KVDtype, KVLayout
from tests.support.group_views import update_status, view_of
from tests.support.waiting import wait_for

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=4, kv_dim=2,
                  dtype=KVDtype.FLOAT32, tokens_per_block=4)
NUM_SLOTS = 512
GROUP = "pool-replica-0"
_MOD = 65521
Buffers = tuple[list[torch.Tensor], list[torch.Tensor]]


def wait_completed(conn: Coordinator, rid: str, timeout: float = 10.0) -> list[str]:
    """Poll ``conn.poll_completed()`` until it reports ``rid``; returns every rid
    it reported meanwhile, in order."""
    done: list[str] = []

    def reported() -> bool:
        done.extend(conn.poll_completed())
        return rid in done

    wait_for(reported, f"store {rid} completed", timeout)
    return done


def prefix_hashes(tokens: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """h[i] identifies tokens[:i + 1] (polynomial rolling hash)."""
    t = np.asarray(tokens, dtype=np.int64)
    out = np.empty(len(t), dtype=np.int64)
    h = 0
    for i, v in enumerate(t.tolist()):
        h = (h * 1_000_003 + v + 1) % (1 << 61)
        out[i] = h
    return out


def kv_content(stage: int, tokens: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Expected KV of every token: shape (tokens, planes, row_elems)."""
    h = prefix_hashes(tokens) % _MOD
    planes = np.arange(LAYOUT.num_planes)[None, :, None]
    elems = np.arange(LAYOUT.row_elems)[None, None, :]
    vals = (h[:, None, None] + stage * 7919 + planes * 104729 + elems * 31) % _MOD
    return vals.astype(np.float32)


def make_buffers() -> Buffers:
    """SGLang-style (k_buffer, v_buffer): per layer (num_slots, heads, head_size)."""
    shape = (NUM_SLOTS, LAYOUT.num_kv_heads, LAYOUT.head_size)
    k = [torch.full(shape, -1.0) for _ in range(LAYOUT.num_layers)]
    v = [torch.full(shape, -1.0) for _ in range(LAYOUT.num_layers)]
    return k, v


def _planes(bufs: Buffers) -> list[torch.Tensor]:
    k, v = bufs
    out: list[torch.Tensor] = []
    for layer in range(LAYOUT.num_layers):
        out += [k[layer].view(NUM_SLOTS, -1), v[layer].view(NUM_SLOTS, -1)]
    return out


def write_slots(bufs: Buffers, slots: npt.ArrayLike,
                values: npt.NDArray[np.float32]) -> None:
    """Write ``values`` (tokens, planes, elems) into ``slots`` (the engine's forward)."""
    idx = torch.as_tensor(np.asarray(slots, dtype=np.int64))
    for p, plane in enumerate(_planes(bufs)):
        plane[idx] = torch.from_numpy(np.ascontiguousarray(values[:, p, :]))


def read_slots(bufs: Buffers,
               slots: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """The buffers' content at ``slots``: (tokens, planes, elems)."""
    idx = torch.as_tensor(np.asarray(slots, dtype=np.int64))
    return np.stack([plane[idx].numpy() for plane in _planes(bufs)], axis=1)


def backend_config(cpu_blocks: int, deferred: bool) -> EmbeddedBackendConfig:
    """Same tier sizes on every stage (the group's minimum)."""
    return EmbeddedBackendConfig(
        layout=LAYOUT, cpu_bytes=cpu_blocks * LAYOUT.bytes_per_block, pinned=False,
        deferred_visibility=deferred, unlaunched_match_seconds=5.0, worker_threads=1,
    )


def group_status(epoch: int, leader: int | None, endpoints: dict[int, str]) -> dict[str, Any]:
    """A KVCacheGroup status (contracts section 3)."""
    members = [{"node": f"node-{r}", "ppRank": r, "fanoutEndpoint": ep, "ready": True}
               for r, ep in sorted(endpoints.items())]
    status: dict[str, Any] = {"epoch": epoch, "members": members, "phase": "Ready"}
    if leader is not None:
        status["leader"] = dict(members[[m["ppRank"] for m in members].index(leader)])
    return status


def make_coordinator(
    rank: int,
    view: GroupViewSource,
    keys: CurveKeys | None,
    cpu_blocks: int = 64,
    endpoint: str | None = "tcp://127.0.0.1:0",
    metrics: AgentMetrics | None = None,
    server: FanoutServer | None = None,
    max_completed: int = 65536,
    max_pending: int = 4096,
    cache_epoch: Callable[[], int] | None = None,
    **timeouts: float,
) -> Coordinator:
    """A connector with the real embedded backend (leader) and TierStore (follower);
    ``cache_epoch`` stands for the agent's ``cacheEpoch`` (its key epoch)."""
    cfg = CoordinatorConfig(
        group=view.view.group, pp_rank=rank, layout=LAYOUT, fanout_endpoint=endpoint,
        # Generous against stalls on a shared 2-core machine; the waits that end
        # tests early (dead stages, lost messages) are bounded by these. They keep
        # fanout_wait + 3 x transfer below engine_call (CoordinatorConfig checks it).
        engine_call_seconds=timeouts.get("engine_call_seconds", 6.0),
        fanout_wait_seconds=timeouts.get("fanout_wait_seconds", 2.5),
        transfer_seconds=timeouts.get("transfer_seconds", 1.1),
        heartbeat_seconds=0.1, leader_timeout_seconds=3.0, max_completed=max_completed,
        max_pending=max_pending,
    )
    return Coordinator(
        cfg, view,
        backend_factory=lambda: EmbeddedBackend(backend_config(cpu_blocks, True)),
        store_factory=lambda: TierStore(backend_config(cpu_blocks, True)),
        keys=keys, metrics=metrics, server=server, cache_epoch=cache_epoch,
    )


def solo_view() -> GroupViewSource:
    """The view of a one-stage group: rank 0 leads epoch 1, no followers."""
    return GroupViewSource(view_of(
        GROUP, group_status(1, 0, {0: "tcp://127.0.0.1:1"})))


def started(conn: Coordinator) -> tuple[Coordinator, Buffers]:
    """Start ``conn`` and register fresh engine buffers (:func:`make_buffers`) as
    its rank 0's; returns both."""
    conn.start()
    bufs = make_buffers()
    conn.register_kv_buffers(0, bufs)
    return conn, bufs


@contextmanager
def single_stage(**kwargs: Any) -> Iterator[tuple[Coordinator, Buffers]]:
    """A started leader of a one-stage group (no fan-out endpoint) and its engine
    buffers; ``kwargs`` go to :func:`make_coordinator`. Closed on exit."""
    conn, bufs = started(make_coordinator(0, solo_view(), keys=None, endpoint=None, **kwargs))
    try:
        yield conn, bufs
    finally:
        conn.close()


class HandFedFollower:
    """A follower role (rank 1 of :data:`GROUP`, epoch 1) over a TierStore of 8 CPU
    blocks, handed its messages one by one with :meth:`deliver`. A context
    manager: started on enter; closed, with its store, on exit."""

    def __init__(self) -> None:
        cfg = CoordinatorConfig(group=GROUP, pp_rank=1, layout=LAYOUT, engine_call_seconds=2.0,
                                fanout_wait_seconds=0.5, transfer_seconds=0.4)
        self.store = TierStore(backend_config(8, True))
        self.store.register_kv_buffers(0, make_buffers())
        self.stats = StreamMetrics(GROUP, None)
        self.role = FollowerRole(cfg, 1, None, self.store, None, self.stats, NUM_SLOTS)

    def __enter__(self) -> HandFedFollower:
        self.role.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.role.close()
        self.store.close()

    def deliver(self, op: Op, seq: int, body: object, incarnation: int = 0) -> None:
        """The follower handles ``body`` as message ``seq`` of the epoch-1 stream of
        the leader process ``incarnation``."""
        self.role.handle(Message(Envelope(op, GROUP, 1, seq, incarnation=incarnation),
                                 body))  # type: ignore[arg-type]


# -- the stage process -------------------------------------------------------------------


class Stage:
    """State of one stage process: its connector and engine buffers."""

    def __init__(self, rank: int, keys: CurveKeys | None, cpu_blocks: int,
                 endpoint: str | None = None) -> None:
        self.rank = rank
        self.metrics = AgentMetrics()
        self.view = GroupViewSource(GroupView(GROUP, 0, None, ()))
        self.conn, self.bufs = started(make_coordinator(
            rank, self.view, keys, cpu_blocks, metrics=self.metrics,
            endpoint=endpoint or "tcp://127.0.0.1:0"))

    def call(self, op: str, args: dict[str, Any]) -> Any:
        c = self.conn
        if op == "endpoint":
            return c.fanout_endpoint
        if op == "view":
            return update_status(self.view, args["status"])
        if op == "store":
            write_slots(self.bufs, args["slots"], kv_content(self.rank, args["tokens"]))
            return c.store_kv(args["rid"], args["tokens"], np.asarray(args["slots"]))
        if op == "store_raw":
            return c.store_kv(args["rid"], args["tokens"], args["slots"])
        if op == "lookup":
            return c.lookup(args["rid"], args["tokens"])
        if op == "retrieve":
            slots = np.asarray(args["slots"], dtype=np.int64)
            write_slots(self.bufs, slots, np.full((len(slots), LAYOUT.num_planes,
                                                   LAYOUT.row_elems), -7.0, np.float32))
            return c.retrieve(args["rid"], slots)
        if op == "read":
            return read_slots(self.bufs, args["slots"])
        if op == "poll":
            return c.poll_completed()
        if op == "release":
            return c.release(args["rid"])
        if op == "status":
            s = c.status()
            s["dropped_metric"] = {
                r: self.metrics.registry.get_sample_value(
                    "flexkv_agent_fanout_dropped_total", {"group": GROUP, "reason": r}) or 0.0
                for r in ("stale_epoch", "gap", "duplicate", "malformed", "future_epoch")
            }
            reg = self.metrics.registry
            s["gauges"] = {
                "role_leader": reg.get_sample_value(
                    "flexkv_agent_pp_role", {"group": GROUP, "role": "leader"}),
                "role_follower": reg.get_sample_value(
                    "flexkv_agent_pp_role", {"group": GROUP, "role": "follower"}),
                "epoch": reg.get_sample_value("flexkv_agent_pp_epoch", {"group": GROUP}),
                "leader_changes": reg.get_sample_value(
                    "flexkv_agent_leader_changes_total", {"group": GROUP}) or 0.0,
                "lag_count": reg.get_sample_value(
                    "flexkv_agent_fanout_lag_seconds_count", {"group": GROUP}) or 0.0,
                "degraded": reg.get_sample_value("flexkv_agent_pp_degraded", {"group": GROUP}),
            }
            return s
        if op == "ready":
            return c.ready()
        if op == "copies_ended":
            # The leader's stores whose own (local) copy has ended: those still in
            # flight (waiting for the followers) and those already published or
            # discarded.
            lead: Any = c._role
            with lead._state:
                waiting = sum(p.local is not None for p in lead._puts.values())
            return waiting + lead.counters.stores_published + lead.counters.stores_discarded
        if op == "faults":
            role = c._role
            stream = getattr(role, "stream", None)
            sender = stream.peer(args["rank"]) if stream is not None else None
            if sender is None:
                raise RuntimeError(f"stage {self.rank} has no sender to rank {args['rank']}")
            plan = sender.faults or FaultPlan()
            sender.faults = plan
            getattr(plan, args["action"])(*args.get("args", ()))
            return True
        if op == "fault_log":
            # (action, ops of the frame it hit): a batch frame carries several.
            role = c._role
            stream = getattr(role, "stream", None)
            sender = stream.peer(args["rank"]) if stream is not None else None
            faults = None if sender is None else sender.faults
            out = []
            for action, frames in ([] if faults is None else faults.log):
                data = frames[0]
                msgs = unpack_batch(data) if is_batch(data) else [data]
                out.append((action, [decode([m]).env.op.name for m in msgs]))
            return out
        raise ValueError(f"unknown op {op!r}")


def stage_main(rank: int, keys: CurveKeys | None, cpu_blocks: int, pipe: Connection,
               endpoint: str | None = None) -> None:
    """Process entry: answer (op, args) requests with ("ok", value) or ("err", text).

    Calls run on a worker thread so a slow call never blocks the pipe reader's
    shutdown; one call at a time, as one engine rank issues them.
    """
    logging.basicConfig(level=os.environ.get("STAGE_LOG", "WARNING"))
    stage = Stage(rank, keys, cpu_blocks, endpoint)
    lock = threading.Lock()
    while True:
        try:
            op, args = pipe.recv()
        except EOFError:
            break
        if op == "stop":
            stage.conn.close()
            pipe.send(("ok", None))
            break
        with lock:
            try:
                pipe.send(("ok", stage.call(op, args)))
            except Exception as exc:
                pipe.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))

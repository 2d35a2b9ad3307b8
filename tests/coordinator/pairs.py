"""An in-process PP group for pairing tests: N connectors, each with its own
fan-out server on loopback (real Curve-less pyzmq sockets), real embedded leader
backend and TierStore followers, and engine buffers of per-stage content.

Every stage runs its engine calls on its own thread (``submit``), as its own
engine rank would, so a test can make one stage lag behind the others and
still let calls that wait on each other (a follower's ``store_kv`` on the
leader's decision, the leader's ``retrieve`` on the followers' loads) proceed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from node_agent.coordinator import Coordinator
from node_agent.coordinator.follower import FollowerRole
from node_agent.metrics import AgentMetrics
from node_agent.pp.channel import FaultPlan
from node_agent.pp.group import GroupViewSource
from node_agent.pp.messages import Op, decode, is_batch, unpack_batch
from node_agent.vocab.group_view import GroupView
from tests.coordinator.harness import (
    GROUP,
    LAYOUT,
    Buffers,
    group_status,
    kv_content,
    make_coordinator,
    read_slots,
    started,
    write_slots,
)
from tests.support.group_views import update_status
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block


class StageThread:
    """One engine rank: runs submitted calls one at a time, in order."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._q: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._t = threading.Thread(target=self._run, name=f"engine-{rank}", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the test through the future
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._q.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._q.put(None)
        self._t.join(timeout=30)


class DropOps(FaultPlan):
    """A fault plan that drops every frame holding a stream message of ``ops``
    (a batch frame is dropped whole), or only the first ``count`` such frames: a
    gap that surely hides those messages."""

    def __init__(self, ops: set[Op], count: int | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.count = count
        self.dropped = 0

    def mangle(self, frames: list[bytes]) -> list[list[bytes]]:
        if self.count is not None and self.dropped >= self.count:
            return [frames]
        data = frames[0]
        msgs = unpack_batch(data) if is_batch(data) else [data]
        if any(decode([m]).env.op in self.ops for m in msgs):
            self.dropped += 1
            self.log.append(("drop", frames))
            return []
        return [frames]


class InProcessGroup:
    """``size`` connectors of one group; rank 0 leads epoch 1. ``cache_epochs[r]``
    is stage ``r``'s ``cacheEpoch`` (its agent's key epoch), 0 at first: a test
    moves it as an agent applying a bump would (key switch, then reset). A
    context manager: closed on exit."""

    def __init__(self, size: int, cpu_blocks: int = 64, max_pending: int = 4096,
                 **timeouts: float) -> None:
        self.views = [GroupViewSource(GroupView(GROUP, 0, None, ())) for _ in range(size)]
        self.metrics = [AgentMetrics() for _ in range(size)]
        self.conns: list[Coordinator] = []
        self.bufs: list[Buffers] = []
        self.threads: list[StageThread] = []
        self.epoch = 0
        self.cache_epochs = [0] * size
        try:
            for r in range(size):
                c, b = started(make_coordinator(
                    r, self.views[r], keys=None, cpu_blocks=cpu_blocks,
                    metrics=self.metrics[r], max_pending=max_pending,
                    cache_epoch=lambda r=r: self.cache_epochs[r], **timeouts))
                self.conns.append(c)
                self.bufs.append(b)
                self.threads.append(StageThread(r))
            self.publish(1)
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> dict[int, str]:
        return {r: c.fanout_endpoint or "" for r, c in enumerate(self.conns)}

    def publish(self, epoch: int, leader: int = 0) -> None:
        self.epoch = epoch
        for v in self.views:
            update_status(v, group_status(epoch, leader, self.endpoints))
        self.wait_ready()

    def wait_ready(self, timeout: float = 15.0) -> None:
        wait_for(lambda: all(c.ready() for c in self.conns), "every stage ready", timeout)

    def __enter__(self) -> InProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for t in self.threads:
            t.stop()
        for c in reversed(self.conns):
            c.close()

    # -- engine calls (run on the stage's own thread) --------------------------------

    def store(self, rank: int, rid: str, tokens: npt.ArrayLike,
              slots: npt.ArrayLike) -> Future[Any]:
        """Write the stage's KV of ``tokens`` into ``slots``, then ``store_kv``."""
        toks, sl = np.asarray(tokens, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        conn, bufs = self.conns[rank], self.bufs[rank]

        def call() -> int:
            write_slots(bufs, sl, kv_content(rank, toks))
            return conn.store_kv(rid, toks, torch.as_tensor(sl))

        return self.threads[rank].submit(call)

    def store_everywhere(self, rid: str, tokens: npt.ArrayLike, base: int = 0,
                         stride: int = 16) -> int:
        r""":meth:`store` on every stage at once, stage ``r`` from the slots at
        ``base + stride * r``; asserts every stage got the same answer, waits until
        the leader :meth:`settle`\ s and returns that answer (the task id)."""
        n = len(np.asarray(tokens))
        futures = [self.store(r, rid, tokens, np.arange(base + stride * r,
                                                        base + stride * r + n))
                   for r in range(len(self.conns))]
        tasks = {f.result(30) for f in futures}
        assert len(tasks) == 1, f"stages got different answers: {tasks}"
        self.settle()
        return int(tasks.pop())

    def call(self, rank: int, fn: Callable[[Coordinator], Any]) -> Future[Any]:
        conn = self.conns[rank]
        return self.threads[rank].submit(lambda: fn(conn))

    def retrieve(self, rank: int, rid: str, slots: npt.ArrayLike) -> Future[Any]:
        """Poison ``slots``, then ``retrieve`` into them."""
        sl = np.asarray(slots, dtype=np.int64)
        conn, bufs = self.conns[rank], self.bufs[rank]

        def call() -> int:
            write_slots(bufs, sl, np.full((len(sl), LAYOUT.num_planes, LAYOUT.row_elems),
                                          -7.0, np.float32))
            return conn.retrieve(rid, torch.as_tensor(sl))

        return self.threads[rank].submit(call)

    def loaded_ok(self, rank: int, tokens: npt.ArrayLike, slots: npt.ArrayLike,
                  loaded: int) -> bool:
        """True when the first ``loaded`` slots hold this stage's KV of exactly
        the first ``loaded`` tokens."""
        if loaded == 0:
            return True
        sl = np.asarray(slots, dtype=np.int64)[:loaded]
        want = kv_content(rank, np.asarray(tokens, dtype=np.int64))[:loaded]
        return bool(np.array_equal(read_slots(self.bufs[rank], sl), want))

    def lookup_everywhere(self, rid: str, tokens: npt.ArrayLike) -> list[int]:
        """``lookup`` on every stage at once; returns each stage's answer."""
        return [f.result(30) for f in
                [self.call(r, lambda c: c.lookup(rid, np.asarray(tokens)))
                 for r in range(len(self.conns))]]

    def follower(self, rank: int) -> FollowerRole:
        """Stage ``rank``'s current role, which must be a follower."""
        role = self.conns[rank]._role
        assert isinstance(role, FollowerRole), f"stage {rank} is not a follower: {role!r}"
        return role

    def load_everywhere(self, rid: str, tokens: npt.ArrayLike,
                        base_slot: int = 400) -> list[int]:
        """lookup + retrieve on every stage at once; asserts each stage loaded
        its own KV of exactly these tokens; returns the retrieve answers."""
        n = len(np.asarray(tokens))
        hits = self.lookup_everywhere(rid, tokens)
        assert len(set(hits)) == 1, f"stages disagree on the hit: {hits}"
        dst = np.arange(base_slot, base_slot + hits[0])
        got = [f.result(30) for f in [self.retrieve(r, rid, dst)
                                      for r in range(len(self.conns))]]
        for r, loaded in enumerate(got):
            assert loaded in (0, hits[0]), (r, loaded, hits)
            assert self.loaded_ok(r, tokens, dst, loaded), f"stage {r} loaded wrong KV"
        assert n >= hits[0]
        return got

    def settle(self, timeout: float = 20.0) -> None:
        """Wait until the leader has no store in flight (every put published or
        discarded, so no copy reads an engine's source slots)."""
        leader = self.conns[0]
        wait_for(lambda: leader.status().get("inflightStores", 0) == 0,
                 "every store terminal on the leader", timeout)

    def caught_up(self, rank: int, timeout: float = 10.0) -> None:
        """Wait until stage ``rank`` applied every stream message the leader sent."""
        lead = self.conns[0]
        wait_for(lambda: self.conns[rank].status()["lastSeq"] >= lead.status()["lastSeq"],
                 f"stage {rank} caught up with the leader's stream", timeout)

    def drop_to(self, rank: int, ops: set[Op], count: int | None = None) -> DropOps:
        """From now on the leader's stream to ``rank`` loses every message of
        ``ops``, or the next ``count`` of them (see :class:`DropOps`);
        :meth:`stop_dropping` ends it."""
        sender = self.conns[0]._role.stream.peer(rank)  # type: ignore[union-attr]
        assert sender is not None, f"the leader has no sender to stage {rank}"
        plan = DropOps(ops, count)
        sender.faults = plan
        return plan

    def stop_dropping(self, rank: int) -> None:
        sender = self.conns[0]._role.stream.peer(rank)  # type: ignore[union-attr]
        if sender is not None:
            sender.faults = None

    def metric(self, rank: int, name: str, **labels: str) -> float:
        return self.metrics[rank].registry.get_sample_value(name, labels) or 0.0

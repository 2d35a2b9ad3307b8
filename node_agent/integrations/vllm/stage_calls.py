"""The data calls of PP stages 1..N-1, made from each stage's own worker process.

Under pipeline parallelism each PP stage holds the KV of its own layers, and its
node's agent holds that stage's share of the cache. vLLM's scheduler runs in one
process, next to stage 0, and in a real cluster cannot reach the agents of the
other stages' nodes. So the scheduler side makes stage 0's calls itself and
records each call it made as a :class:`StageOp` (same rid, tokens, token span and
blocks); the ops travel to every worker in the step's connector metadata, and TP
rank 0 of every other stage makes the same calls on its own node's agent, in the
same order, from a thread of its own (:class:`StageCaller`). The agents pair the
calls by content (docs/pp.md): the group's leader decides, every stage copies
exactly the tokens decided, between its own agent and its own KV blocks.

What the calls answer on stages 1..N-1 is not used for decisions: stage 0's
``retrieve`` answers the hit only when every stage loaded (a load is all or
nothing), and stage 0's ``poll_completed`` reports a store once it ended on every
stage. A stage reports each ``retrieve`` it made once that call returned (its
copy into vLLM's blocks can no longer run): the scheduler reports a load finished
to vLLM, loaded or to recompute, only after every stage reported it, so no copy
writes into blocks vLLM computes or hands to another request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from node_agent.client import AGENT_ERRORS, AgentHealth, EngineClient, RankInfo, SlotsInUseError

log = logging.getLogger(__name__)

#: Poll period of the stage's completed stores while any is in flight.
POLL_SECONDS = 0.05
#: Stores this long without a completion are no longer polled for.
STORE_FORGET_SECONDS = 120.0
#: The rid of the probe's call (see ``scheduler_side.PROBE_RID``).
PROBE_RID = "flexkv-connector-probe"


@dataclass(frozen=True)
class StageOp:
    """One call stage 0 made, to make on every other stage.

    ``kind``: ``lookup`` (``tokens``, token span ``span``), ``retrieve``
    (``blocks``), ``store`` (``tokens``, ``blocks``) or ``release``."""

    kind: str
    rid: str
    tokens: np.ndarray | None = None
    span: tuple[int, int] | None = None
    blocks: tuple[int, ...] = ()


_POLL = StageOp("poll", "")


def block_slots(block_ids: Iterable[int], block_size: int) -> np.ndarray:
    """Every slot of ``block_ids`` in order (slot = block * block_size + offset)."""
    base = np.asarray(list(block_ids), dtype=np.int64)
    return (base[:, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1)


class StageCaller:
    """Makes one PP stage's data calls on its own agent, in the order stage 0 made them.

    ``submit`` queues a step's ops and never blocks; a thread makes the calls, each
    bounded by ``timeout``. :meth:`take_loads_ended` returns the rids whose
    ``retrieve`` returned since the last call (also when it failed or was skipped);
    :meth:`take_loads_stuck` those of them answered ``SlotsInUse`` (the agent's copy
    did not stop and may still write the blocks: the scheduler must never hand them
    back to vLLM).
    While the agent is down (a call failed because of it) no call is made until a
    probe, every ``retry_seconds``, is answered."""

    def __init__(self, socket: str, rank: RankInfo, block_size: int, timeout: float,
                 retry_seconds: float) -> None:
        self.rank = rank
        self.block_size = block_size
        self.timeout = timeout
        self._client = EngineClient(socket, rank, timeout=timeout)
        self._probe_client = EngineClient(socket, rank, timeout=timeout)
        self.health = AgentHealth(retry_seconds,
                                  probe=lambda: self._probe_client.release(PROBE_RID),
                                  log=log, name=f"FlexKV agent of PP stage {rank.pp_rank}")
        self._ops: queue.Queue[StageOp | None] = queue.Queue()
        self._lock = threading.Lock()
        self._ended: set[str] = set()
        self._stuck: set[str] = set()
        self._stores: dict[str, float] = {}  # rid -> when its store started
        self._closing = threading.Event()
        self.calls = 0
        self._thread = threading.Thread(target=self._loop, name="flexkv-stage-calls",
                                        daemon=True)
        self._thread.start()

    def submit(self, ops: Iterable[StageOp]) -> None:
        """Queue ``ops`` (made in order, on the caller's thread never)."""
        for op in ops:
            self._ops.put(op)

    def take_loads_ended(self) -> set[str]:
        """The rids whose ``retrieve`` on this stage returned since the last call."""
        with self._lock:
            ended, self._ended = self._ended, set()
        return ended

    def take_loads_stuck(self) -> set[str]:
        """The rids whose ``retrieve`` on this stage answered ``SlotsInUse`` since the
        last call: this stage's copy may still write their blocks at any later time."""
        with self._lock:
            stuck, self._stuck = self._stuck, set()
        return stuck

    def _loop(self) -> None:
        while True:
            try:
                op: StageOp | None = self._ops.get(
                    timeout=POLL_SECONDS if self._stores else None)
            except queue.Empty:
                op = _POLL
            if op is None or self._closing.is_set():
                return
            if op is not _POLL:
                self._call(op)
            if self._stores:
                self._poll()

    def _call(self, op: StageOp) -> None:
        try:
            if self.health.should_call():
                self.calls += 1
                self._make(op)
                self.health.succeeded()
        except SlotsInUseError as exc:
            log.error("FlexKV load of %s could not be stopped by the agent of PP stage %s; "
                      "its %s blocks are kept out of use for the engine's life: %s", op.rid,
                      self.rank.pp_rank, len(op.blocks), exc)
            with self._lock:
                self._stuck.add(op.rid)
        except AGENT_ERRORS as exc:
            self.health.failed(op.kind, exc)
        except Exception as exc:
            log.warning("FlexKV %s of %s refused on PP stage %s: %s", op.kind, op.rid,
                        self.rank.pp_rank, exc)
        finally:
            if op.kind == "retrieve":
                with self._lock:
                    self._ended.add(op.rid)

    def _make(self, op: StageOp) -> None:
        c = self._client
        if op.kind == "lookup":
            assert op.tokens is not None and op.span is not None
            mask = np.zeros(len(op.tokens), dtype=bool)
            mask[op.span[0]:op.span[1]] = True
            c.lookup(op.rid, op.tokens, mask)
        elif op.kind == "retrieve":
            c.retrieve(op.rid, block_slots(op.blocks, self.block_size))
        elif op.kind == "store":
            assert op.tokens is not None
            if c.store_kv(op.rid, op.tokens, block_slots(op.blocks, self.block_size)) >= 0:
                self._stores[op.rid] = time.monotonic()
        elif op.kind == "release":
            c.release(op.rid)
        else:
            raise ValueError(f"unknown stage op kind {op.kind!r}")

    def _poll(self) -> None:
        """Drain this stage's completed stores (the agent keeps them until polled)."""
        try:
            done = set(self._client.poll_completed()) if self.health.should_call() else set()
        except AGENT_ERRORS as exc:
            self.health.failed("poll_completed", exc)
            done = set(self._stores)
        now = time.monotonic()
        for rid, started in list(self._stores.items()):
            if rid in done or now - started > STORE_FORGET_SECONDS:
                del self._stores[rid]

    def close(self) -> None:
        """Stop the thread (bounded by one call) and close the sockets. The calls still
        queued are dropped, never made: the engine is going away."""
        self._closing.set()
        with self._ops.mutex:
            self._ops.queue.clear()
        self._ops.put(None)
        self.health.close()
        self._thread.join(timeout=self.timeout + 1.0)
        self._client.close()
        self._probe_client.close()

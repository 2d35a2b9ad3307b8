"""The agent's KV-event publisher: a bounded queue, one sender thread, a ZMQ PUB socket.

Contract:

* :meth:`StageEvents.stored`, :meth:`StageEvents.moved` and
  :meth:`StageEvents.cleared` are what a backend calls, under its own lock, on the
  data path: each is one ``put_nowait`` of a tuple. When the queue is full the
  item is dropped and counted (``flexkv_agent_kv_events_dropped_total``); a store
  is never delayed.
* A dropped move or clear (or a batch the sender failed to translate or send)
  would leave a subscriber holding blocks that are gone
  (and the sender remembering them for ever): the sender then ends its next
  batch with ``AllBlocksCleared`` and forgets every announced block, so what a
  subscriber holds stays a subset of the cache. A dropped store only leaves its
  blocks (and the runs stored on top of them) unannounced.
* The sender thread turns items into events (hashing blocks the vLLM way when
  configured), sends every item it finds queued as one ``KVEventBatch`` with the
  next sequence number, and skips one sequence number after any drop, so a
  subscriber sees a gap exactly when it missed events.
* ``endpoint`` is bound (``tcp://*:5558``, ``tcp://0.0.0.0:5558``, ``ipc://...``).
  A PUB socket never blocks its sender: a slow subscriber loses messages past the
  high-water mark. No replay socket is offered: the agent's state is the cache
  itself, so a subscriber that saw a gap asks ``POST /v1/lookup`` or waits for
  the blocks to be stored again.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from node_agent.events import wire
from node_agent.events.hashes import VllmHasher
from node_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

#: Items one batch holds at most (a burst is cut into several batches).
BATCH_ITEMS = 1024
#: How long ``close`` waits for the sender to flush what is queued.
CLOSE_SECONDS = 2.0
_LOW64 = (1 << 64) - 1

_STORED, _MOVED, _CLEARED = 0, 1, 2
_MEDIUM = {"cpu": wire.MEDIUM_CPU, "ssd": wire.MEDIUM_SSD, "remote": wire.MEDIUM_REMOTE}


class KvEventsBindError(RuntimeError):
    """The events endpoint cannot be bound (the message names it and the fix)."""


class _Block:
    """What the sender remembers of one announced block (sender thread only)."""

    __slots__ = ("ext", "parent", "raw", "tier", "tokens")

    def __init__(self, ext: wire.ExternalHash, raw: bytes | None, tier: str, tokens: bytes,
                 parent: int | None) -> None:
        self.ext, self.raw, self.tier, self.tokens, self.parent = ext, raw, tier, tokens, parent


class StageEvents:
    """The events of one stage's backend. The backend calls :meth:`stored`,
    :meth:`moved` and :meth:`cleared` (never blocking); the sender thread calls
    :meth:`translate`."""

    def __init__(self, publisher: KvEventPublisher, block_size: int,
                 hasher: VllmHasher | None) -> None:
        self._publisher = publisher
        self.block_size = block_size
        self._hasher = hasher
        self._blocks: dict[int, _Block] = {}

    # -- data path (the backend's lock is held) ------------------------------------------

    def stored(self, hashes: Sequence[int], parent: int | None,
               tokens: npt.NDArray[np.int64]) -> None:
        """Blocks ``hashes`` (agent hashes, chain order, after agent hash ``parent``)
        became visible on the CPU tier; ``tokens`` are their tokens in order."""
        self._publisher.offer((self, _STORED, list(hashes), parent, tokens))

    def moved(self, block_hash: int, src: str, dst: str | None) -> None:
        """Block ``block_hash`` left tier ``src`` for tier ``dst`` (None: dropped)."""
        self._publisher.offer((self, _MOVED, block_hash, src, dst))

    def cleared(self) -> None:
        """Every block of the stage is gone (a flush, a reset, the stage closed)."""
        self._publisher.offer((self, _CLEARED))

    def close(self) -> None:
        """The stage closed (after its last :meth:`cleared`): the publisher stops
        counting it among its stages."""
        self._publisher.forget(self)

    def forget_blocks(self) -> None:
        """Forget every announced block (sender thread: the stream was cleared)."""
        self._blocks = {}

    # -- sender thread ---------------------------------------------------------------------

    def translate(self, item: tuple[Any, ...], only_stage: bool) -> list[wire.Event]:
        """The events of one queued item; ``only_stage`` when no other stage
        publishes here (a clear is then ``AllBlocksCleared``)."""
        kind = item[1]
        if kind == _STORED:
            return self._stored(item[2], item[3], item[4])
        if kind == _MOVED:
            return self._moved(item[2], item[3], item[4])
        return self._cleared(only_stage)

    def _ext(self, block_hash: int) -> wire.ExternalHash:
        return block_hash if block_hash <= _LOW64 else block_hash.to_bytes(
            (block_hash.bit_length() + 7) // 8, "big")

    def _stored(self, hashes: list[int], parent: int | None,
                tokens: npt.NDArray[np.int64]) -> list[wire.Event]:
        bs = self.block_size
        per_block = np.ascontiguousarray(tokens[: len(hashes) * bs], dtype="<i8")
        blocks: list[list[int]] = per_block.reshape(-1, bs).tolist()
        if len(blocks) != len(hashes):
            log.warning("Stored event dropped: tokens do not cover the blocks",
                        extra={"blocks": len(hashes), "tokens": len(tokens)})
            return []
        known = self._blocks.get(parent) if parent is not None else None
        if parent is not None and known is None:
            # The parent was never announced (recovered from SSD, or its event was
            # dropped): its chain hash is unknown, so this run cannot be hashed.
            self._publisher.count_unannounced(len(hashes))
            return []
        parent_ext = known.ext if known is not None else None
        if self._hasher is not None:
            raws: list[bytes | None] = list(self._hasher.chain(
                known.raw if known is not None else None, blocks))
            exts: list[wire.ExternalHash] = [self._hasher.external(r) for r in raws if r]
        else:
            raws = [None] * len(hashes)
            exts = [self._ext(h) for h in hashes]
        prev = parent
        for h, raw, ext, block in zip(hashes, raws, exts, blocks, strict=True):
            self._blocks[h] = _Block(ext, raw, "cpu", np.asarray(block, "<i8").tobytes(), prev)
            prev = h
        return [wire.block_stored(exts, parent_ext, per_block.tolist(), bs, wire.MEDIUM_CPU)]

    def _moved(self, block_hash: int, src: str, dst: str | None) -> list[wire.Event]:
        block = self._blocks.get(block_hash)
        if block is None:
            return []  # never announced: nothing to take back
        out = [wire.block_removed([block.ext], _MEDIUM[src])]
        if dst is None:
            del self._blocks[block_hash]
            return out
        block.tier = dst
        parent = self._blocks.get(block.parent) if block.parent is not None else None
        tokens = np.frombuffer(block.tokens, dtype="<i8").tolist()
        out.append(wire.block_stored([block.ext], parent.ext if parent is not None else None,
                                     tokens, self.block_size, _MEDIUM[dst]))
        return out

    def _cleared(self, only_stage: bool) -> list[wire.Event]:
        blocks, self._blocks = self._blocks, {}
        if only_stage:
            return [wire.all_blocks_cleared()]
        by_tier: dict[str, list[wire.ExternalHash]] = {}
        for b in blocks.values():
            by_tier.setdefault(b.tier, []).append(b.ext)
        return [wire.block_removed(hashes, _MEDIUM[tier]) for tier, hashes in by_tier.items()]


class KvEventPublisher:
    """One agent's event stream (see the module docstring). ``block_hash`` is
    ``"vllm-sha256"`` (vLLM's hash with ``seed``) or ``"agent"`` (the agent's own)."""

    name = "kv_events"

    def __init__(self, endpoint: str, *, topic: str = "", queue_size: int = 10_000,
                 block_hash: str = "vllm-sha256", seed: str = "vllm-none-hash",
                 int_hashes: bool = True, metrics: AgentMetrics | None = None) -> None:
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=queue_size)
        self._block_hash = block_hash
        self._seed = seed
        self._int_hashes = int_hashes
        self._metrics = metrics
        self._stages: list[StageEvents] = []
        self._stages_lock = threading.Lock()
        self.dropped = 0
        """Items dropped because the queue was full (since start)."""
        self.dropped_removals = 0
        """Of :attr:`dropped`, the moves and clears (they take blocks back)."""
        self._cleared_removals = 0
        self.unannounced = 0
        """Stored blocks not announced because their parent's hash was unknown."""
        self.seq = 0
        """The sequence number the next batch gets."""
        self._sent_drops = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- lifecycle (an HTTP lifespan service) -------------------------------------------------

    def open(self) -> None:
        """Bind the PUB socket and start the sender thread; :class:`KvEventsBindError`
        naming ``kvEvents.endpoint`` when the endpoint cannot be bound."""
        self._ctx = zmq.Context()
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            pub.bind(self.endpoint)
        except zmq.ZMQError as exc:
            pub.close(0)
            self._ctx.term()
            self._ctx = None
            why = os.strerror(exc.errno) if exc.errno is not None else str(exc)
            raise KvEventsBindError(
                f"kvEvents.endpoint {self.endpoint!r} cannot be bound: {why}; free "
                "that port (another process of the pod or node listens on it) or give the "
                "KV events a port of their own (spec.kvEvents.port of the pool)") from exc
        self._pub = pub
        self._thread = threading.Thread(target=self._run, name="flexkv-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events published", extra={"endpoint": self.endpoint,
                                               "block_hash": self._block_hash})

    async def start(self) -> None:
        self.open()

    async def stop(self) -> None:
        self.close()

    def close(self) -> None:
        """Send what is queued (bounded by ``CLOSE_SECONDS``), then close the socket."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(CLOSE_SECONDS)
        if self._pub is not None:
            self._pub.close(0)
            self._pub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    @property
    def alive(self) -> bool:
        """True while the sender thread runs (or before it started)."""
        return self._thread is None or self._thread.is_alive() or self._stopping.is_set()

    # -- stages -----------------------------------------------------------------------------

    def stage(self, block_size: int) -> StageEvents:
        """The events of a new stage whose blocks hold ``block_size`` tokens."""
        hasher = VllmHasher(self._seed, self._int_hashes) \
            if self._block_hash == "vllm-sha256" else None
        events = StageEvents(self, block_size, hasher)
        with self._stages_lock:
            self._stages.append(events)
        return events

    def forget(self, events: StageEvents) -> None:
        """``events``' stage closed: it no longer counts as a stage of this publisher
        (queued behind its last events)."""
        try:
            self._queue.put_nowait((events, -1))
        except queue.Full:
            with self._stages_lock:
                if events in self._stages:
                    self._stages.remove(events)

    def offer(self, item: tuple[Any, ...]) -> bool:
        """Queue ``item`` without blocking; False (dropped and counted) when full."""
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            if item[1] != _STORED:
                self.dropped_removals += 1
            self.dropped += 1
            if self._metrics is not None:
                self._metrics.kv_events_dropped.inc()
            return False

    def count_unannounced(self, blocks: int) -> None:
        """``blocks`` stored blocks could not be announced (sender thread)."""
        self.unannounced += blocks
        if self._metrics is not None:
            self._metrics.kv_events_dropped.inc(blocks)

    # -- sender thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            items = [first]
            while len(items) < BATCH_ITEMS:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._send(items)
            except Exception:  # keep publishing: one bad item must not end the stream
                log.exception("KV event batch not sent", extra={"items": len(items)})
                self._lost(len(items))

    def _lost(self, items: int) -> None:
        """A batch of ``items`` failed (sender thread): it may have held removals, so
        it counts as a lost removal, and a batch with the gap and ``AllBlocksCleared``
        goes out at once."""
        self.dropped += 1
        self.dropped_removals += 1
        if self._metrics is not None:
            self._metrics.kv_events_dropped.inc(items)
        try:
            self._send([])
        except Exception:
            log.exception("KV event clear not sent after a failed batch")

    def _send(self, items: list[tuple[Any, ...] | None]) -> None:
        events: list[wire.Event] = []
        for item in items:
            if item is None:
                continue
            stage = item[0]
            if item[1] == -1:
                with self._stages_lock:
                    if stage in self._stages:
                        self._stages.remove(stage)
                continue
            with self._stages_lock:
                only = len(self._stages) <= 1
            events.extend(stage.translate(item, only))
        drops = self.dropped
        if drops != self._sent_drops:  # a gap tells subscribers they missed events
            self._sent_drops = drops
            self.seq += 1
        removals = self.dropped_removals
        if removals != self._cleared_removals:
            # A block taken back without its event: nobody can tell which, so every
            # announced block is taken back (a subscriber misses, never holds a lie).
            self._cleared_removals = removals
            with self._stages_lock:
                stages = list(self._stages)
            for st in stages:
                st.forget_blocks()
            events.append(wire.all_blocks_cleared())
            log.warning("KV events lost a removal: every announced block cleared",
                        extra={"dropped_removals": removals})
        if not events or self._pub is None:
            return
        payload = wire.encode_batch(time.time(), events)
        self._pub.send_multipart([self._topic, wire.seq_frame(self.seq), payload],
                                 flags=zmq.NOBLOCK)
        self.seq += 1
        if self._metrics is not None:
            self._metrics.kv_events.inc(len(events))

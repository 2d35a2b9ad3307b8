"""The write-behind queue: blocks go to the remote tier behind the engine's back.

:meth:`WriteBehind.offer` never blocks and never copies: it appends
``(block id, CPU block, generation)`` to a bounded deque, or drops the block and
counts it (``queue_full``) when the deque holds ``capacity`` blocks. One worker
thread drains the queue in batches through a caller-supplied ``flush`` function
(:meth:`~.tier.RemoteTier.write_batch`), which copies the blocks out of the CPU
tier and puts them, and drops any block whose CPU copy changed since it was
offered (``overwritten``). So ``store_kv`` is never slowed by the remote tier,
and the queue's memory is bounded by ``capacity`` small tuples.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from node_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

#: One queued write: remote block id, CPU block index, CPU block generation when offered.
Pending = tuple[int, int, int]


class WriteBehind:
    """A bounded queue of blocks to write, drained by one worker thread.

    ``flush(batch)`` writes up to ``batch_blocks`` entries; it must not raise
    (failures are counted by it). ``on_idle`` is signalled whenever the queue runs
    empty and no flush is running (for :meth:`drain`)."""

    def __init__(self, capacity: int, batch_blocks: int,
                 flush: Callable[[list[Pending]], None],
                 metrics: AgentMetrics | None = None, name: str = "remote-writer") -> None:
        if capacity < 1 or batch_blocks < 1:
            raise ValueError(f"capacity={capacity} and batch_blocks={batch_blocks} must be >= 1; "
                             "set tiers.remote.queueBlocks and localBufferSize to hold a block")
        self.capacity = capacity
        self.batch_blocks = batch_blocks
        self._flush = flush
        self._metrics = metrics
        self._queue: deque[Pending] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.offered = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._loop, name=f"flexkv-{name}", daemon=True)
        self._thread.start()

    def offer(self, items: list[Pending]) -> int:
        """Queue ``items``; returns how many were accepted (the rest are dropped and
        counted as ``queue_full``). Never blocks on the remote tier."""
        if not items:
            return 0
        with self._cond:
            if self._closed:
                return 0
            room = max(0, self.capacity - len(self._queue))
            take = items[:room]
            self._queue.extend(take)
            self.offered += len(take)
            dropped = len(items) - len(take)
            self.dropped += dropped
            depth = len(self._queue)
            self._cond.notify_all()
        if self._metrics is not None:
            self._metrics.remote_queue_depth.set(depth)
            if dropped:
                self._metrics.remote_dropped_blocks.labels(reason="queue_full").inc(dropped)
        return len(take)

    @property
    def depth(self) -> int:
        """Blocks waiting (not counting the batch being written)."""
        return len(self._queue)

    def drain(self, timeout: float) -> bool:
        """Wait until the queue is empty and no batch is being written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker; blocks still queued are dropped (``closed``)."""
        with self._cond:
            self._closed = True
            left = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if left and self._metrics is not None:
            self._metrics.remote_dropped_blocks.labels(reason="closed").inc(left)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                n = min(self.batch_blocks, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
                self._busy = True
                depth = len(self._queue)
            if self._metrics is not None:
                self._metrics.remote_queue_depth.set(depth)
            try:
                self._flush(batch)
            except Exception:
                log.exception("Remote write-behind batch failed", extra={"blocks": len(batch)})
                if self._metrics is not None:
                    self._metrics.remote_dropped_blocks.labels(reason="error").inc(len(batch))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

"""Copy lanes: the planes of one large CPU copy spread over a few threads.

A copy of a task is a list of independent *items* (one plane each: a few torch
row ops). One thread running them back to back leaves the second core idle
while a row gather waits on memory, and torch's own intra-op split of each op
is static: when another process holds one core, every op waits for its slower
half. :func:`run_items` instead lets ``lanes`` threads (the caller plus
``lanes - 1`` helpers from one process-wide pool) take items from a shared
counter, so a lane that is held up simply takes fewer items.

Contract: every item runs at most once; each lane calls ``before_item`` before
every item (the copy's abort checkpoint) and stops at the first exception of
any lane; :func:`run_items` returns or raises only after every lane has
stopped, so nothing a copy started still writes afterwards. The first
exception is re-raised in the caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _helpers(n: int) -> ThreadPoolExecutor:
    """The process-wide helper pool, grown to at least ``n`` threads."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n:
            # The old pool's idle threads exit when it is shut down; running
            # helpers of other copies finish their items first.
            old = _pool
            _pool = ThreadPoolExecutor(n, thread_name_prefix="flexkv-copy-lane")
            _pool_size = n
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def run_items(items: Sequence[Callable[[], None]], lanes: int,
              before_item: Callable[[], None]) -> None:
    """Run every item of ``items`` once over ``lanes`` threads (see module docstring)."""
    if lanes <= 1 or len(items) <= 1:
        for item in items:
            before_item()
            item()
        return
    lock = threading.Lock()
    state = {"next": 0}
    failed: list[BaseException] = []

    def lane() -> None:
        while True:
            with lock:
                i = state["next"]
                if failed or i >= len(items):
                    return
                state["next"] = i + 1
            try:
                before_item()
                items[i]()
            except BaseException as exc:  # handed to the caller below
                with lock:
                    failed.append(exc)
                return

    n = min(lanes, len(items))
    pool = _helpers(n - 1)
    futures: list[Future[None]] = [pool.submit(lane) for _ in range(n - 1)]
    lane()
    for f in futures:
        f.result()
    if failed:
        raise failed[0]

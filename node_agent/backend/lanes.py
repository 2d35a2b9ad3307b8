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

Where a process keeps its lanes apart (:func:`keep_lanes_apart`, the agent) and
a copy has at least as many lanes as the calling thread may use CPUs (two lanes
on a two-core node or pod), each lane keeps to its own CPU for the copy: the
caller's lane to the CPU it started on, the helpers to the others; every
thread's own affinity is restored when its lane ends. Otherwise the lanes stack
on one CPU while another idles: a lane waiting for the GIL between items sleeps,
the lane that releases it wakes it, and the scheduler places a woken thread on
the waker's CPU when no CPU is idle at that instant (a socket thread answering,
say); its balancer moves it back only at a later tick, milliseconds on, when
the copy is nearly done (docs/agent.md, "Copy lanes on two cores"). Only a
copy that runs alone is pinned: one that starts while another runs is not, and
the lanes of a pinned copy give their affinity back at their next item once
another copy started (the scheduler then balances the threads of both). With
spare CPUs nothing is pinned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
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


def _cpu_reader() -> Callable[[], int] | None:
    """libc's ``sched_getcpu`` (the CPU the calling thread runs on), or None where
    it or thread affinity is missing (the lanes then are never pinned)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


_current_cpu = _cpu_reader()
_apart = False
"""Whether copies keep their lanes on separate CPUs (:func:`keep_lanes_apart`)."""

PIN_VARIABLE = "FLEXKV_PIN_COPY_LANES"
"""``0`` turns :func:`keep_lanes_apart` off in the agent (``flexkv-agent``)."""


def keep_lanes_apart(on: bool = True) -> bool:
    """From now on, copies in this process keep each lane on its own CPU where the
    lanes are as many as the caller's CPUs (module docstring); returns whether
    that is on (never where the CPU or the thread affinity cannot be read or
    set). Only the agent turns it on: its copy lanes and transfer threads are
    its own, while in an engine process (:mod:`node_agent.engine_loads`) the
    caller is the engine's thread. A torch operation that starts OpenMP workers
    inside a lane gives them that lane's CPU for good (a thread inherits its
    creator's affinity); the agent's lanes run the row kernel, not torch,
    wherever its library is built (:mod:`.row_kernel`)."""
    global _apart
    _apart = on and _current_cpu is not None
    return _apart


_copies_lock = threading.Lock()
_copies = 0
"""Copies of this process running over several lanes now."""


def _home_cpu(lanes: int) -> int | None:
    """The CPU the caller's lane keeps to, or None when the lanes stay unpinned
    (not kept apart, fewer lanes than the caller's CPUs, one CPU, no way to tell,
    or another copy running: lanes of two copies share the CPUs anyway, and two
    copies started on one CPU would both keep their caller's lane there)."""
    if not _apart or _current_cpu is None or _copies > 1:
        return None
    allowed = os.sched_getaffinity(0)
    cpu = _current_cpu()
    if len(allowed) < 2 or len(allowed) > lanes or cpu not in allowed:
        return None
    return cpu


class _Affinity:
    """One lane thread's narrowed affinity, given back by :meth:`restore` (at
    most once; also when another copy starts, :meth:`restore_if_shared`)."""

    def __init__(self, cpus: Callable[[set[int]], set[int]] | None) -> None:
        self._own: set[int] = set()
        if cpus is None:
            return
        own = os.sched_getaffinity(0)
        narrowed = cpus(set(own))
        if not narrowed or narrowed == own:
            return
        try:
            os.sched_setaffinity(0, narrowed)
        except OSError:  # a CPU gone offline or a cpuset changed since: run anywhere
            return
        self._own = own

    def restore_if_shared(self) -> None:
        if self._own and _copies > 1:
            self.restore()

    def restore(self) -> None:
        own, self._own = self._own, set()
        if own:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, own)


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

    def lane(cpus: Callable[[set[int]], set[int]] | None) -> None:
        pinned = _Affinity(cpus)
        try:
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
                pinned.restore_if_shared()
        finally:
            pinned.restore()

    global _copies
    n = min(lanes, len(items))
    with _copies_lock:
        _copies += 1
    try:
        home = _home_cpu(n)
        pool = _helpers(n - 1)
        futures: list[Future[None]] = [
            pool.submit(lane, None if home is None else (lambda own: own - {home}))
            for _ in range(n - 1)]
        lane(None if home is None else (lambda own: {home}))
        for f in futures:
            f.result()
    finally:
        with _copies_lock:
            _copies -= 1
    if failed:
        raise failed[0]

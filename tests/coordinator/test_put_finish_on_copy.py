"""A finished copy finishes its put on the copy's own thread when nothing else
is awaited (a single-stage group: no follower ack), without the leader's reaper;
and it never blocks there, so a decision (or a flush) holding the decision lock
leaves the put to the reaper."""

from __future__ import annotations

import threading

import numpy as np
import torch

from node_agent.coordinator.leader import LeaderRole
from tests.coordinator.harness import kv_content, write_slots


def _leader(conn) -> LeaderRole:  # type: ignore[no-untyped-def]
    role = conn._role
    assert isinstance(role, LeaderRole)
    return role


def _stop_reaper(role: LeaderRole) -> None:
    role._stop.set()
    role._wake.set()
    role._reaper.join(10)
    assert not role._reaper.is_alive()


def test_a_single_stage_store_completes_and_loads_with_the_reaper_stopped(
        single) -> None:  # type: ignore[no-untyped-def]
    conn, bufs = single
    role = _leader(conn)
    _stop_reaper(role)
    tokens = np.arange(100, 164)
    write_slots(bufs, np.arange(64), kv_content(0, tokens))
    assert conn.store_kv("s", tokens, torch.arange(64)) >= 0
    # Only the copy's thread can have finished it: the reaper is gone.
    assert conn.wait_completed(20.0) == ["s"]
    status = conn.status()
    assert status["inflightStores"] == 0
    assert status["counters"]["stores_published"] == 1
    conn.release("s")
    assert conn.lookup("q", tokens) == 64
    assert conn.retrieve("q", torch.arange(100, 164)) == 64


def test_a_copy_ending_while_the_decision_lock_is_held_never_blocks_its_thread(
        single) -> None:  # type: ignore[no-untyped-def]
    conn, bufs = single
    role = _leader(conn)
    _stop_reaper(role)
    copied = threading.Event()
    role.backend.set_completion_listener(copied.set)  # the copy only signals
    tokens = np.arange(500, 532)
    write_slots(bufs, np.arange(32), kv_content(0, tokens))
    assert conn.store_kv("h", tokens, torch.arange(32)) >= 0
    assert copied.wait(20)
    # A decision (a flush, say, which waits for copy threads) holds the lock:
    # finishing from a copy's thread returns at once and finishes nothing.
    with role._decide:
        t = threading.Thread(target=role._on_copy_done)
        t.start()
        t.join(10)
        assert not t.is_alive()
        assert conn.status()["inflightStores"] == 1
        assert conn.wait_completed(0.0) == []
    # The next copy's end (or the reaper) finishes it, published.
    role._on_copy_done()
    assert conn.wait_completed(5.0) == ["h"]
    status = conn.status()
    assert status["inflightStores"] == 0
    assert status["counters"]["stores_published"] == 1


class _PausingLock:
    """The decision lock, but its release on ``thread_name``'s thread waits for
    ``go`` after telling ``released``: a seam to run something in the gap
    between a put finisher letting go of the decision lock and its next step."""

    def __init__(self, inner: threading.Lock, thread_name: str) -> None:
        self._inner = inner
        self._name = thread_name
        self.released = threading.Event()
        self.go = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._inner.acquire(blocking, timeout)

    def release(self) -> None:
        self._inner.release()
        if threading.current_thread().name == self._name:
            self.released.set()
            assert self.go.wait(20)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_put_a_copy_thread_finishes_is_reported_whenever_the_role_is_drained(
        single) -> None:  # type: ignore[no-untyped-def]
    """A copy's thread may still be finishing its put when the role is closed
    (a shared backend's tenant leaving waits only for running copies): the
    put's rid is in the in-flight stores or in the reportable rids at every
    moment, so ``take_unreported`` never misses it."""
    conn, bufs = single
    role = _leader(conn)
    _stop_reaper(role)
    copied = threading.Event()
    role.backend.set_completion_listener(copied.set)
    tokens = np.arange(700, 732)
    write_slots(bufs, np.arange(32), kv_content(0, tokens))
    assert conn.store_kv("u", tokens, torch.arange(32)) >= 0
    assert copied.wait(20)
    lock = _PausingLock(role._decide, "copy-finisher")  # type: ignore[arg-type]
    role._decide = lock  # type: ignore[assignment]
    t = threading.Thread(target=role._on_copy_done, name="copy-finisher")
    t.start()
    try:
        assert lock.released.wait(20)
        # The finisher let go of the decision lock: the put is ended.
        unreported = role.take_unreported()
    finally:
        lock.go.set()
        t.join(20)
    assert not t.is_alive()
    assert unreported == ["u"]

"""Copy lanes kept on separate CPUs (:func:`node_agent.backend.lanes.keep_lanes_apart`):
where a copy has as many lanes as its caller's CPUs, the caller's lane runs only
on the CPU it started on and every helper only elsewhere; each thread gets its
own affinity back when its lane ends, also when an item fails; with spare CPUs,
or with the switch off, nothing is pinned."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import pytest

from node_agent.backend import lanes

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or lanes._current_cpu is None
    or len(os.sched_getaffinity(0)) < 2,
    reason="needs thread affinity, sched_getcpu and two CPUs")


@pytest.fixture()
def two_cpus() -> Iterator[set[int]]:
    """The calling thread on two of its CPUs (lanes apart), restored afterwards."""
    own = os.sched_getaffinity(0)
    pair = set(sorted(own)[:2])
    os.sched_setaffinity(0, pair)
    was = lanes._apart
    assert lanes.keep_lanes_apart(True)
    try:
        yield pair
    finally:
        lanes.keep_lanes_apart(was)
        os.sched_setaffinity(0, own)


def _recorder(seen: list[tuple[int, frozenset[int]]]) -> Callable[[], None]:
    lock = threading.Lock()

    def item() -> None:
        with lock:
            seen.append((threading.get_native_id(), frozenset(os.sched_getaffinity(0))))

    return item


def _affinities() -> dict[int, frozenset[int]]:
    """Every thread of this process (the helper pool's included) -> its affinity."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
    return out


def _same_affinities(before: dict[int, frozenset[int]]) -> bool:
    """Every thread that existed before has its affinity of then again."""
    after = _affinities()
    return all(after[t] == a for t, a in before.items() if t in after)


def test_each_lane_keeps_to_its_own_cpu_and_gets_its_affinity_back(
        two_cpus: set[int]) -> None:
    lanes._helpers(1).submit(lambda: None).result()  # the helper thread exists now
    before = _affinities()
    caller = threading.get_native_id()
    seen: list[tuple[int, frozenset[int]]] = []
    item = _recorder(seen)
    ran: set[int] = set()
    # Enough items, each long enough, that both lanes take some.
    gate = threading.Barrier(2, timeout=10)

    def first() -> None:
        item()
        ran.add(threading.get_native_id())
        gate.wait()

    lanes.run_items([first, first] + [item] * 30, 2, lambda: None)
    assert len(seen) == 32 and len(ran) == 2  # the barrier: both lanes ran an item
    homes = {aff for tid, aff in seen if tid == caller}
    others = {aff for tid, aff in seen if tid != caller}
    [home] = homes
    assert len(home) == 1 and home < two_cpus
    assert others and all(not (aff & home) for aff in others)
    # Every thread has its own affinity again.
    assert os.sched_getaffinity(0) == two_cpus
    assert _same_affinities(before)


def test_a_failing_item_still_gives_every_lane_its_affinity_back(two_cpus: set[int]) -> None:
    lanes._helpers(1).submit(lambda: None).result()
    before = _affinities()
    gate = threading.Barrier(2, timeout=10)

    def meet() -> None:
        gate.wait()

    def bad() -> None:
        raise RuntimeError("plane 3 failed")

    with pytest.raises(RuntimeError, match="plane 3 failed"):
        lanes.run_items([meet, meet, bad] + [lambda: None] * 5, 2, lambda: None)
    assert os.sched_getaffinity(0) == two_cpus
    assert _same_affinities(before)


def _unpinned_items(allowed: set[int]) -> None:
    """Two lanes on a caller allowed ``allowed``: every item runs with it as is."""
    seen: list[tuple[int, frozenset[int]]] = []
    lanes.run_items([_recorder(seen)] * 8, 2, lambda: None)
    callers = {aff for tid, aff in seen if tid == threading.get_native_id()}
    assert callers <= {frozenset(allowed)}
    assert os.sched_getaffinity(0) == allowed


def test_lanes_are_not_pinned_when_switched_off(two_cpus: set[int]) -> None:
    lanes.keep_lanes_apart(False)
    assert lanes._home_cpu(2) is None
    _unpinned_items(two_cpus)


def test_lanes_are_not_pinned_with_a_spare_cpu() -> None:
    own = os.sched_getaffinity(0)
    if len(own) < 3:
        pytest.skip("needs three CPUs")
    three = set(sorted(own)[:3])
    was = lanes._apart
    os.sched_setaffinity(0, three)
    try:
        lanes.keep_lanes_apart(True)
        assert lanes._home_cpu(2) is None and lanes._home_cpu(3) is not None
        _unpinned_items(three)
    finally:
        lanes.keep_lanes_apart(was)
        os.sched_setaffinity(0, own)


def test_only_a_copy_running_alone_is_pinned(two_cpus: set[int]) -> None:
    """A copy that starts while another runs is not pinned, and the running
    copy's lanes give their affinity back at their next item."""
    lanes._helpers(3)  # room for both copies' helpers
    a_in = threading.Barrier(3, timeout=10)  # both lanes of A, and this thread
    b_running = threading.Event()
    a_after = threading.Event()
    seen_a: list[tuple[str, int, frozenset[int]]] = []
    seen_b: list[tuple[int, frozenset[int]]] = []
    lock = threading.Lock()

    def note(phase: str) -> None:
        with lock:
            seen_a.append((phase, threading.get_native_id(),
                           frozenset(os.sched_getaffinity(0))))

    def gate() -> None:
        note("alone")
        a_in.wait()
        assert b_running.wait(10)

    def after() -> None:
        note("shared")
        if sum(1 for p, _, _ in seen_a if p == "shared") >= 2:
            a_after.set()

    def b_item() -> None:
        b_running.set()
        with lock:
            seen_b.append((threading.get_native_id(), frozenset(os.sched_getaffinity(0))))
        assert a_after.wait(10)

    first = threading.Thread(target=lanes.run_items,
                             args=([gate, gate] + [after] * 6, 2, lambda: None))
    first.start()
    a_in.wait()  # A runs alone, pinned
    second = threading.Thread(target=lanes.run_items, args=([b_item] * 4, 2, lambda: None))
    second.start()
    second.join(20)
    first.join(20)
    assert not first.is_alive() and not second.is_alive()
    alone = {aff for p, _, aff in seen_a if p == "alone"}
    assert len(alone) == 2 and any(len(aff) == 1 for aff in alone)  # A was pinned
    # B never was, and A's lanes ran unpinned once B ran.
    assert len(seen_b) == 4 and all(len(aff) > 1 for _, aff in seen_b)
    shared = [aff for p, _, aff in seen_a if p == "shared"]
    assert len(shared) == 6 and all(len(aff) > 1 for aff in shared)
    assert lanes._copies == 0


def test_without_sched_getcpu_lanes_are_never_kept_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lanes, "_current_cpu", None)
    was = lanes._apart
    try:
        assert lanes.keep_lanes_apart(True) is False
        assert lanes._home_cpu(2) is None
    finally:
        lanes._apart = was

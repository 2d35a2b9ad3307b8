"""A one-stage group (leader, real embedded backend): a copy that outlives its
wait is cancelled and ended before the engine is answered or the rid reported;
a role change reports every store the engine had not polled; rejected inputs
consume the call number; retrieve after a missed lookup is a miss."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.coordinator import UnknownRequestError
from node_agent.coordinator.leader import LeaderRole
from tests.coordinator.harness import (
    GROUP,
    LAYOUT,
    group_status,
    kv_content,
    make_coordinator,
    solo_view,
    started,
    wait_completed,
    write_slots,
)
from tests.support.group_views import view_of
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block
Bufs = tuple[list[torch.Tensor], list[torch.Tensor]]


class Single:
    def __init__(self, **timeouts: float) -> None:
        self.view = solo_view()
        self.conn, self.bufs = started(
            make_coordinator(0, self.view, keys=None, endpoint=None, **timeouts))
        self.events: list[str] = []

    @property
    def leader(self) -> LeaderRole:
        role = self.conn._role
        assert isinstance(role, LeaderRole)
        return role

    def store(self, rid: str, tokens: np.ndarray, slots: np.ndarray) -> int:
        write_slots(self.bufs, slots, kv_content(0, tokens))
        return self.conn.store_kv(rid, tokens, torch.as_tensor(slots))

    def gate_copies(self) -> threading.Event:
        """Hold the backend's copies until the leader cancels; log both events."""
        backend: Any = self.leader.backend
        gate = threading.Event()
        copy, cancel = backend._store.copy, backend.cancel

        def gated_copy(*args: Any, **kwargs: Any) -> None:
            try:
                assert gate.wait(10.0), "the leader never cancelled the copy"
                copy(*args, **kwargs)
            finally:
                self.events.append("copy-ended")

        def logged_cancel(task_ids: Any) -> None:
            self.events.append("cancel")
            cancel(task_ids)
            gate.set()

        backend._store.copy = gated_copy
        backend.cancel = logged_cancel
        return gate

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def fast() -> Iterator[Single]:
    s = Single(engine_call_seconds=1.0, fanout_wait_seconds=0.3, transfer_seconds=0.2)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def single() -> Iterator[Single]:
    s = Single()
    try:
        yield s
    finally:
        s.close()


def test_timed_out_load_is_ended_before_retrieve_answers(fast: Single) -> None:
    tokens = np.arange(2 * TPB)
    assert fast.store("src", tokens, np.arange(2 * TPB)) >= 0
    wait_completed(fast.conn, "src")
    assert fast.conn.lookup("dst", tokens) == 2 * TPB
    fast.gate_copies()
    got = fast.conn.retrieve("dst", torch.arange(100, 100 + 2 * TPB))
    fast.events.append("answered")
    assert got == 0  # cancelled: a miss, the slots are garbage
    # (a miss cancels the task once more on its way out: harmless, it ended)
    assert fast.events[:2] == ["cancel", "copy-ended"]
    assert fast.events.index("copy-ended") < fast.events.index("answered")


def test_timed_out_store_is_reported_only_after_its_copy_ended(fast: Single) -> None:
    fast.gate_copies()
    assert fast.store("slow", np.arange(2 * TPB), np.arange(2 * TPB)) >= 0
    wait_completed(fast.conn, "slow")
    fast.events.append("reported")
    assert fast.events == ["cancel", "copy-ended", "reported"]
    assert fast.conn.lookup("again", np.arange(2 * TPB)) == 0  # nothing was published


def test_role_change_reports_unpolled_completions(single: Single) -> None:
    assert single.store("r1", np.arange(2 * TPB), np.arange(2 * TPB)) >= 0
    wait_for(lambda: single.leader.status()["completedQueued"] == 1,
             "r1 terminal, not yet polled")
    single.view.update(view_of(GROUP, group_status(2, 0, {0: "tcp://127.0.0.1:1"})))
    assert single.conn.poll_completed() == ["r1"]


def test_role_change_reports_stores_in_flight(single: Single) -> None:
    gate = single.gate_copies()
    assert single.store("r2", np.arange(2 * TPB), np.arange(2 * TPB)) >= 0
    assert single.leader.status()["inflightStores"] == 1
    gate.set()  # the backend shutdown of the closing role ends the copy
    single.view.update(view_of(GROUP, group_status(2, 0, {0: "tcp://127.0.0.1:1"})))
    assert single.conn.poll_completed() == ["r2"]
    assert "copy-ended" in single.events


def test_rejected_calls_leave_the_stream_untouched(single: Single) -> None:
    seq = single.leader.stream.seq
    with pytest.raises(ValueError, match="token_ids has 8 entries but kv_indices has 7"):
        single.conn.store_kv("r", np.arange(2 * TPB), torch.arange(2 * TPB - 1))
    with pytest.raises(ValueError, match="kv_indices is None"):
        single.conn.store_kv("r", np.arange(2 * TPB), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"token_ids has dtype torch\.bfloat16"):
        single.conn.store_kv("r", torch.arange(2 * TPB, dtype=torch.bfloat16),
                             torch.arange(2 * TPB))
    with pytest.raises(ValueError, match="token_mask"):
        single.conn.lookup("r", np.arange(2 * TPB), np.ones(3, bool))
    assert single.leader.stream.seq == seq  # no decision, no call number


def test_retrieve_after_a_missed_lookup_is_a_miss_once(single: Single) -> None:
    assert single.conn.lookup("m", np.arange(2 * TPB)) == 0
    assert single.conn.retrieve("m", torch.zeros(0, dtype=torch.int64)) == 0
    with pytest.raises(UnknownRequestError):
        single.conn.retrieve("m", torch.zeros(0, dtype=torch.int64))


def test_a_failed_match_is_refused_counted_and_its_task_cancelled(
        single: Single, caplog: pytest.LogCaptureFixture) -> None:
    """The backend matched but the leader could not take the plan: the call is
    refused (a store answers -1, a lookup 0), counted as a manager error, logged,
    and the matched task cancelled so its blocks are not left locked."""
    tokens = np.arange(2 * TPB)
    assert single.store("cached", tokens, np.arange(2 * TPB)) >= 0
    wait_completed(single.conn, "cached")
    backend: Any = single.leader.backend
    cancelled: list[int] = []
    cancel = backend.cancel

    def broken_plan(task_id: int) -> Any:
        raise RuntimeError(f"no plan for task {task_id}")

    def logged_cancel(task_ids: Any) -> None:
        cancelled.extend(task_ids)
        cancel(task_ids)

    backend.plan_of = broken_plan
    backend.cancel = logged_cancel
    assert single.store("new", np.arange(100, 100 + 2 * TPB), np.arange(2 * TPB)) == -1
    assert single.conn.lookup("hit", tokens) == 0
    assert single.leader.counters.manager_errors == 2
    assert len(cancelled) == 2
    assert backend.stats().tasks["matched"] == 0
    assert sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "Leader ")) == ["Leader get_match failed", "Leader put_match failed"]

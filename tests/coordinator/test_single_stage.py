"""A group of one stage (no followers) with the real embedded backend: the
store_kv contract of SGLang's FlexKV connector, input validation, round trips,
completion, lookup replacement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node_agent.coordinator import Coordinator, UnknownRequestError
from node_agent.metrics import AgentMetrics
from tests.coordinator.harness import (
    GROUP,
    LAYOUT,
    kv_content,
    make_coordinator,
    read_slots,
    single_stage,
    solo_view,
    wait_completed,
    write_slots,
)
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block


def _store(conn: Coordinator, bufs: object, rid: str, tokens: np.ndarray, slots: np.ndarray) -> int:
    write_slots(bufs, slots, kv_content(0, tokens))  # type: ignore[arg-type]
    return conn.store_kv(rid, tokens, torch.as_tensor(slots))


def test_a_length_mismatch_raises_naming_both_counts_and_writes_nothing(single) -> None:  # type: ignore[no-untyped-def]
    conn, bufs = single
    tokens = np.arange(16)
    before = read_slots(bufs, np.arange(16))
    with pytest.raises(ValueError,
                       match="store_kv: token_ids has 16 entries but kv_indices has 15 entries"):
        conn.store_kv("r", tokens, torch.arange(15))
    np.testing.assert_array_equal(read_slots(bufs, np.arange(16)), before)
    assert conn.lookup("r", tokens) == 0
    assert conn.status()["counters"]["stores"] == 0


@pytest.mark.parametrize(
    "slots, reason",
    [
        (np.r_[np.arange(15), -1], "negative slot"),
        (np.r_[np.arange(15), 3], "3 2 times"),
        (np.r_[np.arange(15), 10_000], "outside the registered"),
        (np.arange(16, dtype=np.float32), "integer slot"),
        (np.arange(32).reshape(16, 2), "1-D"),
    ],
)
def test_bad_indices_raise_and_nothing_is_written(single, slots: np.ndarray, reason: str) -> None:  # type: ignore[no-untyped-def]
    conn, _ = single
    tokens = np.arange(16)
    with pytest.raises(ValueError, match=reason):
        conn.store_kv("r", tokens, slots)
    assert conn.lookup("r", tokens) == 0


def test_round_trip_into_other_slots_is_bit_exact(single) -> None:  # type: ignore[no-untyped-def]
    conn, bufs = single
    tokens = np.arange(100, 100 + 4 * TPB + 3)  # trailing partial block is not stored
    src = np.arange(50, 50 + len(tokens))
    task = _store(conn, bufs, "a", tokens, src)
    assert task >= 0
    wait_completed(conn, "a")
    assert conn.lookup("b", tokens) == 4 * TPB
    dst = np.arange(300, 300 + 4 * TPB)
    write_slots(bufs, dst, np.zeros((len(dst), LAYOUT.num_planes, LAYOUT.row_elems), np.float32))
    assert conn.retrieve("b", dst) == 4 * TPB
    np.testing.assert_array_equal(read_slots(bufs, dst), kv_content(0, tokens)[: 4 * TPB])


def test_cached_prefix_is_skipped_and_short_input_returns_minus_one(single) -> None:  # type: ignore[no-untyped-def]
    conn, bufs = single
    tokens = np.arange(2 * TPB)
    assert _store(conn, bufs, "a", tokens, np.arange(2 * TPB)) >= 0
    wait_completed(conn, "a")
    assert _store(conn, bufs, "b", tokens, np.arange(10, 10 + 2 * TPB)) == -1
    assert conn.store_kv("c", np.arange(TPB - 1), np.arange(TPB - 1)) == -1


def test_second_lookup_replaces_the_first_and_unknown_rid_is_named(single) -> None:  # type: ignore[no-untyped-def]
    conn, bufs = single
    tokens = np.arange(3 * TPB)
    assert _store(conn, bufs, "a", tokens, np.arange(3 * TPB)) >= 0
    wait_completed(conn, "a")
    assert conn.lookup("q", tokens) == 3 * TPB
    assert conn.lookup("q", tokens[: 2 * TPB]) == 2 * TPB  # cancels the first task
    dst = np.arange(200, 200 + 2 * TPB)
    assert conn.retrieve("q", dst) == 2 * TPB
    with pytest.raises(UnknownRequestError, match="unknown request id 'q'"):
        conn.retrieve("q", dst)
    with pytest.raises(UnknownRequestError, match="'nope'"):
        conn.retrieve("nope", dst)
    stats = conn._role.backend.stats()  # type: ignore[union-attr]
    assert stats.tasks.get("matched", 0) == 0  # the replaced lookup did not leak a lock


def test_retrieve_with_wrong_slot_count_raises(single) -> None:  # type: ignore[no-untyped-def]
    conn, bufs = single
    tokens = np.arange(2 * TPB)
    _store(conn, bufs, "a", tokens, np.arange(2 * TPB))
    wait_completed(conn, "a")
    assert conn.lookup("q", tokens) == 2 * TPB
    with pytest.raises(ValueError, match="selects 8 tokens"):
        conn.retrieve("q", np.arange(3))


def test_status_and_ready(single) -> None:  # type: ignore[no-untyped-def]
    conn, _ = single
    s = conn.status()
    assert (s["role"], s["group"], s["epoch"], s["degraded"], s["ready"]) == (
        "leader", GROUP, 1, False, True)
    assert conn.ready()


def test_completed_rids_are_bounded_and_overflow_is_counted() -> None:
    """An engine that never polls cannot grow the completed list without end: the
    oldest rids are dropped beyond ``max_completed`` and counted (status, metric)."""
    metrics = AgentMetrics()
    with single_stage(metrics=metrics, max_completed=3) as (conn, bufs):
        rids = [f"r{i}" for i in range(5)]
        for i, rid in enumerate(rids):  # distinct prompts, so each one is stored
            tokens = np.arange(1000 * i, 1000 * i + 2 * TPB)
            assert _store(conn, bufs, rid, tokens, np.arange(2 * TPB) + 10 * i) >= 0
        wait_for(lambda: not conn.status()["inflightStores"], "every store terminal")
        s = conn.status()
        assert (s["completedQueued"], s["completedDropped"]) == (3, 2)
        assert metrics.registry.get_sample_value(
            "flexkv_agent_completed_dropped_total", {"group": GROUP}) == 2.0
        assert conn.poll_completed() == rids[2:]  # the newest, in completion order
        assert conn.poll_completed() == []


def test_max_completed_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_completed=0 must be an int >= 1"):
        make_coordinator(0, solo_view(), keys=None, endpoint=None, max_completed=0)


def test_a_rank_registering_again_with_more_slots_can_use_them(single) -> None:  # type: ignore[no-untyped-def]
    """A restarted engine may register a larger KV cache than before: the slot bound
    is the smallest *current* registration, not the smallest ever seen."""
    conn, bufs = single
    small = tuple([t[:2 * TPB].clone() for t in group] for group in bufs)
    conn.register_kv_buffers(0, small)
    tokens = np.arange(500, 500 + 2 * TPB)
    high = np.arange(len(bufs[0][0]) - 2 * TPB, len(bufs[0][0]))
    with pytest.raises(ValueError, match="outside the registered buffers"):
        conn.store_kv("r-small", tokens, torch.as_tensor(high))
    conn.register_kv_buffers(0, bufs)
    assert _store(conn, bufs, "r-big", tokens, high) >= 0

"""A two-stage group in one process (two connectors, two fan-out servers on
loopback, real embedded backend and TierStore): an engine call whose inputs
only one stage rejects leaves the stream untouched, and the next calls still
pair with the leader decisions made for their tokens."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from node_agent.coordinator import Coordinator
from node_agent.pp.group import GroupViewSource
from node_agent.vocab.group_view import GroupView
from tests.support.group_views import update_status

from .harness import (
    GROUP,
    LAYOUT,
    group_status,
    kv_content,
    make_buffers,
    make_connector,
    wait_for,
    write_slots,
)

TPB = LAYOUT.tokens_per_block


@pytest.fixture
def pair() -> Iterator[tuple[Coordinator, Coordinator]]:
    views = [GroupViewSource(GroupView(GROUP, 0, None, ())) for _ in range(2)]
    conns = [make_connector(r, views[r], keys=None) for r in range(2)]
    try:
        for c in conns:
            c.start()
            c.register_kv_buffers(0, make_buffers())
        eps = {r: c.fanout_endpoint or "" for r, c in enumerate(conns)}
        for v in views:
            update_status(v, group_status(1, 0, eps))
        wait_for(lambda: all(c.ready() for c in conns), "both stages ready")
        yield conns[0], conns[1]
    finally:
        for c in reversed(conns):
            c.close()


def _valid(conn: Coordinator, rid: str, blocks: int, base: int) -> int:
    tokens = np.arange(base, base + blocks * TPB)
    slots = np.arange(blocks * TPB)
    bufs = conn._buffers[0]
    write_slots(bufs, slots, kv_content(conn.cfg.pp_rank, tokens))  # type: ignore[arg-type]
    return conn.store_kv(rid, tokens, torch.as_tensor(slots))


def test_leader_only_rejection_keeps_follower_calls_paired(
        pair: tuple[Coordinator, Coordinator]) -> None:
    leader, follower = pair
    with pytest.raises(ValueError, match="kv_indices has"):
        leader.store_kv("r", np.arange(2 * TPB), torch.arange(2 * TPB - 1))
    # The leader decided nothing for its rejected call: the follower's call ends
    # without a decision (bounded), -1.
    assert _valid(follower, "r", 2, 0) == -1
    task = _valid(leader, "r", 2, 1000)
    assert task >= 0
    assert _valid(follower, "r", 2, 1000) == task


def test_follower_only_rejection_keeps_its_calls_paired(
        pair: tuple[Coordinator, Coordinator]) -> None:
    leader, follower = pair
    first = _valid(leader, "r", 1, 0)
    assert first >= 0
    with pytest.raises(ValueError, match="kv_indices has"):
        follower.store_kv("r", np.arange(TPB), torch.arange(TPB - 1))
    second = _valid(leader, "r", 1, 2000)
    assert second >= 0 and second != first
    assert _valid(follower, "r", 1, 2000) == second

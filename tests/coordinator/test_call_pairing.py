"""A two-stage group in one process (two connectors, two fan-out servers on
loopback, real embedded backend and TierStore): an engine call whose inputs
only one stage rejects leaves the stream untouched, and the next calls still
pair with the leader decisions made for their tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node_agent.coordinator import Coordinator
from tests.coordinator.harness import (
    LAYOUT,
    kv_content,
    write_slots,
)
from tests.coordinator.pairs import InProcessGroup

TPB = LAYOUT.tokens_per_block


def _valid(conn: Coordinator, rid: str, blocks: int, base: int) -> int:
    tokens = np.arange(base, base + blocks * TPB)
    slots = np.arange(blocks * TPB)
    bufs = conn._buffers[0]
    write_slots(bufs, slots, kv_content(conn.cfg.pp_rank, tokens))  # type: ignore[arg-type]
    return conn.store_kv(rid, tokens, torch.as_tensor(slots))


def test_leader_only_rejection_keeps_follower_calls_paired(
        pair: InProcessGroup) -> None:
    leader, follower = pair.conns
    with pytest.raises(ValueError, match="kv_indices has"):
        leader.store_kv("r", np.arange(2 * TPB), torch.arange(2 * TPB - 1))
    # The leader decided nothing for its rejected call: the follower's call ends
    # without a decision (bounded), -1.
    assert _valid(follower, "r", 2, 0) == -1
    task = _valid(leader, "r", 2, 1000)
    assert task >= 0
    assert _valid(follower, "r", 2, 1000) == task


def test_follower_only_rejection_keeps_its_calls_paired(
        pair: InProcessGroup) -> None:
    leader, follower = pair.conns
    first = _valid(leader, "r", 1, 0)
    assert first >= 0
    with pytest.raises(ValueError, match="kv_indices has"):
        follower.store_kv("r", np.arange(TPB), torch.arange(TPB - 1))
    second = _valid(leader, "r", 1, 2000)
    assert second >= 0 and second != first
    assert _valid(follower, "r", 1, 2000) == second

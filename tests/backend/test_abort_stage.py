"""Stoppable stage copies: ``TierStore.execute`` aborts a timed-out copy and joins
it before raising, so nothing writes the slots or blocks afterwards.

Copies are paused mid-way with the copier's checkpoint hook (called before every
run / plane copy); nothing here synchronises by sleeping.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.backend.stage_store import TierStore
from node_agent.vocab.placement import BlockLocation, Direction, Tier, TierMove, TransferPlan
from tests.backend.backend_helpers import TPB, PauseAt, config, make_buffers, planes, small_layout


def no_stage_copy_thread() -> bool:
    return not any(t.name == "flexkv-stage-copy" for t in threading.enumerate())


@pytest.fixture
def stage() -> tuple[TierStore, list[list[torch.Tensor]]]:
    layout = small_layout()
    st = TierStore(config(layout, cpu_blocks=8))
    bufs = make_buffers(layout, 64, 7)
    st.register_kv_buffers(0, bufs)
    blocks = (BlockLocation(Tier.CPU, 0), BlockLocation(Tier.CPU, 1))
    st.execute(TransferPlan(Direction.STORE, blocks), np.arange(2 * TPB), timeout=5)
    return st, bufs


LOAD_PLAN = TransferPlan(Direction.LOAD, (BlockLocation(Tier.CPU, 0), BlockLocation(Tier.CPU, 1)))
MID_COPY_TIMEOUT = 1.0
"""Timeout of the tests that pause a copy after its first checkpoint: long enough
that the part before the pause finishes first even on a loaded machine (the
pause itself only ends when the timeout aborts the copy)."""
TARGET = np.arange(32, 32 + 2 * TPB)


def test_timed_out_load_is_stopped_before_execute_raises(
        stage: tuple[TierStore, list[list[torch.Tensor]]]) -> None:
    st, bufs = stage
    before = planes(bufs, TARGET)
    hook = PauseAt(1)  # before the first byte
    st.copier.checkpoint_hook = hook
    with pytest.raises(TimeoutError, match=r"load of 2 blocks \(blocks cpu:0, cpu:1\) did not "
                       r"finish in 0\.05 s; the copy was stopped; the engine slots hold "
                       r"undefined data and must not be used"):
        st.execute(LOAD_PLAN, TARGET, timeout=0.05)
    assert hook.entered.is_set() and no_stage_copy_thread()
    st.copier.checkpoint_hook = None
    assert all(torch.equal(a, b) for a, b in zip(before, planes(bufs, TARGET), strict=True))


def test_timed_out_load_stops_mid_copy_within_one_plane(
        stage: tuple[TierStore, list[list[torch.Tensor]]]) -> None:
    st, bufs = stage
    source = planes(bufs, np.arange(2 * TPB))
    before = planes(bufs, TARGET)
    hook = PauseAt(2)  # the first plane is copied, then the copy pauses
    st.copier.checkpoint_hook = hook
    with pytest.raises(TimeoutError, match="undefined data"):
        st.execute(LOAD_PLAN, TARGET, timeout=MID_COPY_TIMEOUT)
    assert no_stage_copy_thread()  # joined: nothing can write the slots any more
    after = planes(bufs, TARGET)
    assert torch.equal(after[0], source[0])  # the plane copied before the pause
    assert all(torch.equal(a, b) for a, b in zip(after[1:], before[1:], strict=True))
    assert hook.calls == 2 and hook.after_abort == 0


def test_timed_out_store_says_the_blocks_are_not_stored(
        stage: tuple[TierStore, list[list[torch.Tensor]]]) -> None:
    st, _ = stage
    block = BlockLocation(Tier.CPU, 5)
    before = st.read_block(block)
    st.copier.checkpoint_hook = PauseAt(1)
    with pytest.raises(TimeoutError, match=r"store of 1 blocks \(blocks cpu:5\) did not finish "
                       r"in 0\.05 s; the copy was stopped; the blocks are not stored"):
        st.execute(TransferPlan(Direction.STORE, (block,)), np.arange(TPB), timeout=0.05)
    assert no_stage_copy_thread()
    assert st.read_block(block) == before
    st.copier.checkpoint_hook = None
    st.execute(TransferPlan(Direction.STORE, (block,)), np.arange(TPB), timeout=5)  # not fenced
    assert st.read_block(block) != before


def test_many_runs_copy_checks_the_abort_per_plane(
        stage: tuple[TierStore, list[list[torch.Tensor]]]) -> None:
    """Scattered blocks (a gathered copy) stop between planes too."""
    st, bufs = stage
    st.execute(TransferPlan(Direction.STORE, tuple(BlockLocation(Tier.CPU, i)
                                                   for i in range(8))),
               np.arange(8 * TPB), timeout=5)
    order = [7, 6, 5, 4, 3, 2, 1, 0, 7]  # 9 one-block runs: gathered, one op per plane
    plan = TransferPlan(Direction.LOAD, tuple(BlockLocation(Tier.CPU, i) for i in order))
    slots = np.arange(20, 20 + len(order) * TPB)
    before = planes(bufs, slots)
    st.copier.checkpoint_hook = PauseAt(2)  # the first plane is copied, then the copy pauses
    with pytest.raises(TimeoutError, match="undefined data"):
        st.execute(plan, slots, timeout=MID_COPY_TIMEOUT)
    after = planes(bufs, slots)
    assert not torch.equal(after[0], before[0])
    assert all(torch.equal(a, b) for a, b in zip(after[1:], before[1:], strict=True))


@pytest.mark.parametrize("aligned", [True, False], ids=["direct-pages", "staged"])
def test_timed_out_ssd_load_stops_mid_copy(tmp_path: Path, aligned: bool) -> None:
    """SSD loads check per block (pages read straight into the engine) or per plane
    (through the staging buffer)."""
    layout = small_layout()
    st = TierStore(config(layout, cpu_blocks=4, ssd_blocks=4, ssd_dir=tmp_path))
    try:
        bufs = make_buffers(layout, 64, 3)
        st.register_kv_buffers(0, bufs)
        cpu = (BlockLocation(Tier.CPU, 0), BlockLocation(Tier.CPU, 1))
        st.execute(TransferPlan(Direction.STORE, cpu), np.arange(2 * TPB), timeout=5)
        ssd = (BlockLocation(Tier.SSD, 2), BlockLocation(Tier.SSD, 3))
        st.apply_moves([TierMove(cpu[0], ssd[0]), TierMove(cpu[1], ssd[1])])
        # aligned: each block one engine page (direct preadv); else token slots
        target = np.arange(32, 32 + 2 * TPB) if aligned else np.arange(33, 33 + 2 * TPB)
        source = planes(bufs, np.arange(2 * TPB))
        before = planes(bufs, target)
        hook = PauseAt(2)
        st.copier.checkpoint_hook = hook
        with pytest.raises(TimeoutError, match=r"blocks ssd:2, ssd:3\).*undefined data"):
            st.execute(TransferPlan(Direction.LOAD, ssd), target, timeout=MID_COPY_TIMEOUT)
        after = planes(bufs, target)
        assert hook.calls == 2
        if aligned:  # block 0 read into its page in every plane, block 1 not
            for a, s, b in zip(after, source, before, strict=True):
                assert torch.equal(a[:TPB], s[:TPB]) and torch.equal(a[TPB:], b[TPB:])
        else:  # plane 0 scattered, the others not
            assert torch.equal(after[0], source[0])
            assert all(torch.equal(a, b) for a, b in zip(after[1:], before[1:], strict=True))
    finally:
        st.close()

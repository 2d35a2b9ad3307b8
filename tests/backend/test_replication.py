"""PP leader hooks (plans, moves, deferred visibility) and follower replay via TierStore."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.backend.base import KVBackendError, KVResponseStatus, TaskNotFoundError
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.stage_store import TierStore
from node_agent.vocab.placement import BlockLocation, Direction, Tier, TierMove, TransferPlan
from tests.backend.backend_helpers import (
    TPB,
    config,
    make_buffers,
    small_layout,
    started,
    store,
    tokens,
)

S = KVResponseStatus


def _leader(tmp_path: Path, cpu: int = 4, ssd: int = 4) -> tuple[EmbeddedBackend, list]:
    cfg = config(small_layout(), cpu_blocks=cpu, ssd_blocks=ssd, ssd_dir=tmp_path / "leader",
                 high_watermark=1.0, low_watermark=1.0, deferred_visibility=True)
    b, [bufs] = started(cfg, num_slots=128)
    return b, bufs


def _put(b: EmbeddedBackend, toks: np.ndarray, slots: np.ndarray) -> int:
    tid, mask = b.put_match(toks)
    [w] = b.launch([tid], [slots[: len(mask)][mask]])
    assert b.wait([w])[w].status is S.SUCCESS
    return w


def test_deferred_put_invisible_until_published(tmp_path: Path) -> None:
    b, _ = _leader(tmp_path)
    try:
        toks = tokens(2 * TPB)
        tid = _put(b, toks, np.arange(2 * TPB, dtype=np.int64))
        assert b.get_match(toks)[0] == -1
        assert b.put_match(toks)[0] == -1  # still owned by the unpublished put
        assert b.stats().tasks["unpublished"] == 1
        b.publish(tid)
        gid, mask = b.get_match(toks)
        assert mask.all()
        b.cancel([gid])
        with pytest.raises(TaskNotFoundError, match="no finished, unpublished put"):
            b.publish(tid)
    finally:
        b.shutdown()


def test_discard_frees_space_and_is_idempotent(tmp_path: Path) -> None:
    b, _ = _leader(tmp_path)
    try:
        toks = tokens(3 * TPB)
        tid = _put(b, toks, np.arange(3 * TPB, dtype=np.int64))
        assert b.stats().tiers["cpu"].used_blocks == 3
        b.discard(tid)
        b.discard(tid)
        assert b.stats().tiers["cpu"].used_blocks == 0
        assert b.get_match(toks)[0] == -1
        assert b.put_match(toks)[0] > 0  # free to store again
    finally:
        b.shutdown()


def test_publish_before_finish_is_refused(tmp_path: Path) -> None:
    b, _ = _leader(tmp_path)
    try:
        tid, _ = b.put_match(tokens(TPB))
        with pytest.raises(KVBackendError, match=f"task {tid} has not finished"):
            b.publish(tid)
    finally:
        b.shutdown()


def test_plan_of_names_physical_blocks(tmp_path: Path) -> None:
    b, _ = _leader(tmp_path, cpu=8)
    try:
        toks = tokens(3 * TPB)
        tid, _ = b.put_match(toks)
        plan = b.plan_of(tid)
        assert plan.direction is Direction.STORE and len(plan.blocks) == 3
        assert all(loc.tier is Tier.CPU for loc in plan.blocks)
        [w] = b.launch([tid], [np.arange(3 * TPB, dtype=np.int64)])
        b.wait([w])
        b.publish(w)
        gid, _ = b.get_match(toks)
        assert b.plan_of(gid) == TransferPlan(Direction.LOAD, plan.blocks)
        with pytest.raises(TaskNotFoundError):
            b.plan_of(10_000)
        g2, _ = b.get_match(toks)
        [batch] = b.launch([gid, g2], [np.arange(12, dtype=np.int64),
                                       np.arange(12, 24, dtype=np.int64)], as_batch=True)
        with pytest.raises(KVBackendError, match="is a batch of"):
            b.plan_of(batch)
        assert b.plan_of(gid).direction is Direction.LOAD  # members keep their plans
        b.wait([batch], completely=True)
    finally:
        b.shutdown()


def test_drain_moves_reports_spills_and_drops_in_order(tmp_path: Path) -> None:
    b, _ = _leader(tmp_path, cpu=2, ssd=2)
    try:
        for i in range(3):
            w = _put(b, tokens(2 * TPB, seed=i), np.arange(2 * TPB, dtype=np.int64))
            b.publish(w)
        moves = b.drain_moves()
        assert b.drain_moves() == []
        spills = [m for m in moves if m.dst is not None]
        drops = [m for m in moves if m.dst is None]
        assert len(spills) == 4 and len(drops) == 2
        assert all(m.src.tier is Tier.CPU and m.dst.tier is Tier.SSD for m in spills if m.dst)
        assert all(m.src.tier is Tier.SSD for m in drops)
        # each drop frees the SSD block the following spill reuses
        assert moves.index(drops[0]) < moves.index(spills[2])
    finally:
        b.shutdown()


def test_single_stage_put_is_visible_at_once_and_queues_no_moves(tmp_path: Path) -> None:
    b, _ = started(config(small_layout(), cpu_blocks=2, ssd_blocks=2, ssd_dir=tmp_path,
                          high_watermark=1.0, low_watermark=1.0))
    try:
        for i in range(2):
            store(b, tokens(2 * TPB, seed=i), np.arange(2 * TPB, dtype=np.int64))
        assert b.stats().tiers["ssd"].used_blocks == 2
        assert b.drain_moves() == []
        assert b.get_match(tokens(2 * TPB, seed=1))[0] > 0
    finally:
        b.shutdown()


def test_follower_replaying_plans_and_moves_ends_bit_identical(tmp_path: Path) -> None:
    layout = small_layout()
    leader, lbufs = _leader(tmp_path, cpu=6, ssd=6)
    fcfg = config(layout, cpu_blocks=6, ssd_blocks=6, ssd_dir=tmp_path / "follower",
                  high_watermark=1.0, low_watermark=1.0)
    follower = TierStore(fcfg)
    fbufs = make_buffers(layout, 128, 1)  # same seed: this stage's KV equals the leader's
    follower.register_kv_buffers(0, fbufs)
    rng = np.random.default_rng(7)
    prompts = [tokens(int(rng.integers(1, 5)) * TPB + 1, seed=s) for s in range(8)]
    try:
        for step in range(30):
            toks = prompts[int(rng.integers(len(prompts)))]
            slots = rng.permutation(128)[: len(toks)].astype(np.int64)
            op = rng.random()
            tid, mask = leader.put_match(toks) if op < 0.6 else leader.get_match(toks)
            follower.apply_moves(leader.drain_moves())
            if tid < 0:
                continue
            plan = leader.plan_of(tid)
            mapping = slots[mask]
            [w] = leader.launch([tid], [mapping])
            follower.execute(plan, mapping, timeout=10)
            assert leader.wait([w])[w].status is S.SUCCESS
            if plan.direction is Direction.STORE:
                (leader.publish if step % 5 else leader.discard)(w)
        follower.apply_moves(leader.drain_moves())
        for tier in (Tier.CPU, Tier.SSD):
            for i in range(6):
                loc = BlockLocation(tier, i)
                assert leader.store.read_block(loc) == follower.read_block(loc), loc
        for x, y in zip([t for g in lbufs for t in g], [t for g in fbufs for t in g], strict=True):
            assert x.view(torch.uint8).equal(y.view(torch.uint8))
    finally:
        leader.shutdown()
        follower.close()


def test_stage_store_execute_validates_before_copying(tmp_path: Path) -> None:
    layout = small_layout()
    st = TierStore(config(layout, cpu_blocks=4))
    st.register_kv_buffers(0, make_buffers(layout, 32, 0))
    before = st.cpu.pool.clone()
    plan = TransferPlan(Direction.STORE, (BlockLocation(Tier.CPU, 0), BlockLocation(Tier.CPU, 1)))
    with pytest.raises(ValueError, match="holds slot 40 at index 7"):
        st.execute(plan, np.r_[np.arange(7), 40], timeout=5)
    with pytest.raises(ValueError, match="plan names cpu block 9 but this stage has 4"):
        st.execute(TransferPlan(Direction.LOAD, (BlockLocation(Tier.CPU, 9),)),
                   np.arange(4), timeout=5)
    with pytest.raises(ValueError, match="stores only target the CPU tier"):
        st.execute(TransferPlan(Direction.STORE, (BlockLocation(Tier.SSD, 0),)),
                   np.arange(4), timeout=5)
    assert st.cpu.pool.equal(before)
    st.execute(plan, np.arange(8), timeout=5)
    assert not st.cpu.pool.equal(before)


def test_stage_store_fences_the_blocks_of_a_copy_that_ignores_its_abort(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hung-device fallback: a copy that does not stop within STOP_SECONDS of
    its abort keeps its blocks fenced until it ends."""
    import node_agent.backend.stage_store as stage_store

    monkeypatch.setattr(stage_store, "STOP_SECONDS", 0.05)
    layout = small_layout()
    release = threading.Event()
    order: list[str] = []

    class StuckStore(TierStore):
        def copy(self, plan: TransferPlan, slots: torch.Tensor,
                 abort: threading.Event | None = None) -> None:
            if plan.blocks[0].index == 0 and not order:
                order.append("stuck started")
                release.wait(10)  # ignores the abort, like a hung device
                order.append("stuck finished")
            else:
                order.append(f"copy {plan.blocks[0].index}")
                super().copy(plan, slots, abort)

    st = StuckStore(config(layout, cpu_blocks=4))
    st.register_kv_buffers(0, make_buffers(layout, 32, 0))
    plan = TransferPlan(Direction.STORE, (BlockLocation(Tier.CPU, 0),))
    try:
        with pytest.raises(TimeoutError, match=r"store of 1 blocks \(blocks cpu:0\) did not "
                           r"finish in 0\.2 s and did not stop within 0\.05 s .* not stored"):
            st.execute(plan, np.arange(4), timeout=0.2)
        # another block is not fenced
        st.execute(TransferPlan(Direction.STORE, (BlockLocation(Tier.CPU, 1),)),
                   np.arange(4), timeout=5)
        # the fenced block refuses a new copy while the late one still runs
        with pytest.raises(TimeoutError, match="earlier copy into blocks cpu:0 timed out"):
            st.execute(plan, np.arange(4, 8), timeout=0.1)
        threading.Timer(0.2, release.set).start()
        st.execute(plan, np.arange(4, 8), timeout=5)  # waits for the late copy, then runs
        assert order == ["stuck started", "copy 1", "stuck finished", "copy 0"]
    finally:
        release.set()


def test_failed_copy_ends_failed_and_frees_the_put(tmp_path: Path) -> None:
    b, _ = started(config(small_layout(), cpu_blocks=4))
    try:
        def broken(plan: TransferPlan, slots: torch.Tensor,
                   abort: threading.Event | None = None) -> None:
            raise OSError("disk on fire")

        b.store.copy = broken  # type: ignore[method-assign]
        toks = tokens(2 * TPB)
        tid, _ = b.put_match(toks)
        [w] = b.launch([tid], [np.arange(2 * TPB, dtype=np.int64)])
        r = b.wait([w])[w]
        assert r.status is S.FAILED and "disk on fire" in (r.error or "")
        assert r.return_mask is not None and not r.return_mask.any()
        assert b.stats().tiers["cpu"].used_blocks == 0
        assert b.get_match(toks)[0] == -1
    finally:
        b.shutdown()


def test_moves_apply_in_order_on_a_store(tmp_path: Path) -> None:
    layout = small_layout()
    st = TierStore(config(layout, cpu_blocks=2, ssd_blocks=2, ssd_dir=tmp_path))
    st.register_kv_buffers(0, make_buffers(layout, 16, 0))
    st.execute(TransferPlan(Direction.STORE, (BlockLocation(Tier.CPU, 0),)), np.arange(4), 5)
    block = st.read_block(BlockLocation(Tier.CPU, 0))
    st.apply_moves([TierMove(BlockLocation(Tier.CPU, 0), BlockLocation(Tier.SSD, 1)),
                    TierMove(BlockLocation(Tier.SSD, 1), BlockLocation(Tier.CPU, 1)),
                    TierMove(BlockLocation(Tier.CPU, 1), None)])
    assert st.read_block(BlockLocation(Tier.SSD, 1)) == block
    assert st.read_block(BlockLocation(Tier.CPU, 1)) == block
    st.close()

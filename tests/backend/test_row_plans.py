"""Row plans and copy lanes: which ops a slot pattern becomes, that every pattern
moves exactly the right rows (bit-exact, through the tiers too), and that lanes
run each plane once, stop on abort and hand errors back only after every lane
stopped."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from node_agent.backend import transfer
from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.lanes import run_items
from node_agent.backend.stage_store import TierStore
from node_agent.backend.transfer import (
    MAX_SEGMENTS,
    CopyAborted,
    OpKind,
    plan_rows,
    run_starts,
)
from node_agent.vocab.placement import BlockLocation, Direction, Tier, TransferPlan
from tests.backend.backend_helpers import config, small_layout, started, store, tokens


def _apply(dst_rows: np.ndarray, src_rows: np.ndarray, n_dst: int, n_src: int,
           ) -> tuple[torch.Tensor, torch.Tensor, list[OpKind]]:
    """Run the plan on random byte rows; returns (result, expected, op kinds)."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (n_src, 24), dtype=torch.uint8, generator=g)
    dst = torch.zeros(n_dst, 24, dtype=torch.uint8)
    want = dst.clone()
    want[torch.as_tensor(dst_rows)] = src[torch.as_tensor(src_rows)]
    ops = plan_rows(dst_rows, src_rows)
    for op in ops:
        op.apply(dst, src)
    return dst, want, [op.kind for op in ops]


def test_run_starts_marks_every_break() -> None:
    assert run_starts(np.array([4, 5, 6, 9, 10, 3])).tolist() == [0, 3, 5]
    assert run_starts(np.array([7])).tolist() == [0]
    assert run_starts(np.array([], dtype=np.int64)).tolist() == []


def test_one_run_on_both_sides_is_one_slice_copy() -> None:
    out, want, kinds = _apply(np.arange(10, 74), np.arange(100, 164), 80, 200)
    assert kinds == [OpKind.SLICE] and out.equal(want)


def test_long_runs_become_slices_short_ones_a_gather() -> None:
    src = np.concatenate([np.arange(0, 40), np.arange(90, 130)])  # two long source runs
    out, want, kinds = _apply(np.arange(80), src, 80, 200)
    assert kinds == [OpKind.SLICE, OpKind.SLICE] and out.equal(want)
    shuffled = np.random.default_rng(1).permutation(200)[:80]  # SGLang page size 1
    out, want, kinds = _apply(np.arange(80), shuffled, 80, 200)
    assert kinds == [OpKind.GATHER] and out.equal(want)


def test_a_load_into_a_permuted_dense_range_is_a_gather() -> None:
    dst = np.random.default_rng(2).permutation(np.arange(50, 150))
    out, want, kinds = _apply(dst, np.arange(100), 160, 100)
    assert kinds == [OpKind.GATHER] and out.equal(want)


def test_scattered_destinations_from_runs_of_sources_are_scatters() -> None:
    dst = np.random.default_rng(3).permutation(1000)[:64]  # > MAX_SEGMENTS dst runs
    assert len(run_starts(np.sort(dst))) > MAX_SEGMENTS
    out, want, kinds = _apply(dst, np.arange(64), 1000, 64)
    assert kinds == [OpKind.SCATTER] and out.equal(want)


def test_scattered_on_both_sides_is_one_general_op_and_repeated_sources_work() -> None:
    rng = np.random.default_rng(4)
    dst = rng.permutation(1000)[:64]
    src = rng.integers(0, 30, 64)  # sources repeat (one block loaded twice)
    out, want, kinds = _apply(dst, src, 1000, 30)
    assert kinds == [OpKind.GENERAL] and out.equal(want)


@pytest.mark.parametrize("seed", range(12))
def test_random_patterns_move_exactly_the_named_rows(seed: int) -> None:
    """Mixed runs, permutations and gaps: the result equals fancy indexing."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    pieces, total = [], 0
    while total < n:  # runs of random lengths at random offsets, no repeats
        k = int(rng.integers(1, 40))
        pieces.append(np.arange(total * 3, total * 3 + k))
        total += k
    dst = np.concatenate(pieces)[:n]
    if seed % 2:
        dst = rng.permutation(dst)
    src = rng.permutation(4 * n)[:n] if seed % 3 else np.arange(n) + 5
    out, want, _ = _apply(dst, src, int(dst.max()) + 1, 4 * n + 5)
    assert out.equal(want)


@pytest.mark.parametrize("seed", range(6))
def test_staged_moves_equal_direct_ones_piece_by_piece(monkeypatch: pytest.MonkeyPatch,
                                                       seed: int) -> None:
    """The host-to-device path (span of source rows sent whole, gathered there),
    run here between CPU tensors: pieces of a few rows, repeated sources, both the
    gather and the general op give exactly the direct op's rows."""
    monkeypatch.setattr(transfer, "DEVICE_STAGE_BYTES", 24 * (1 + seed))  # 1..6 rows a piece
    rng = np.random.default_rng(seed)
    n = 40
    src_rows = 2 * rng.permutation(n) + 7  # no two consecutive: no run to slice
    src_rows[::5] = src_rows[1::5]  # sources may repeat
    for dst_rows in (np.arange(3, 3 + n), rng.permutation(2 * n)[:n]):
        g = torch.Generator().manual_seed(seed)
        src = torch.randint(0, 256, (2 * n + 10, 24), dtype=torch.uint8, generator=g)
        want = torch.zeros(2 * n + 5, 24, dtype=torch.uint8)
        got = want.clone()
        ops = plan_rows(dst_rows, src_rows)
        assert [op.kind for op in ops] in ([OpKind.GATHER], [OpKind.GENERAL])
        for op in ops:
            op.apply(want, src)
            assert op.apply_staged(got, src)
        assert got.equal(want)
        pieces = ops[0]._stage_plan(got.device, 1 + seed)
        assert pieces is not None and len(pieces) > 1
        assert all(hi - lo <= 1 + seed for lo, hi, _, _ in pieces)
        assert sum(len(rows) for _, _, rows, _ in pieces) == n


@pytest.mark.parametrize("seed", range(4))
def test_moves_through_the_two_half_stage_equal_direct_ones(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The host-gathered (into a device) and host-scattered (out of one) moves, run
    here between CPU tensors: pieces of a few rows alternate between the stage's
    two halves, and every kind of op gives exactly the direct op's rows."""
    monkeypatch.setattr(transfer, "HOST_STAGE_BYTES", 2 * 64 * (1 + seed))  # 2..5 rows a half
    rng = np.random.default_rng(seed)
    n = 33
    patterns = [(np.arange(5, 5 + n), 3 * rng.permutation(n)),  # gather, sparse sources
                (rng.permutation(3 * n)[:n], np.arange(n)),  # scatters
                (rng.permutation(3 * n)[:n], 3 * rng.permutation(n))]  # one general op
    for dst_rows, src_rows in patterns:
        g = torch.Generator().manual_seed(seed)
        src = torch.randint(0, 256, (3 * n, 24), dtype=torch.uint8, generator=g)
        want = torch.zeros(3 * n + 5, 24, dtype=torch.uint8)
        gathered, scattered = want.clone(), want.clone()
        for op in plan_rows(dst_rows, src_rows):
            op.apply(want, src)
            assert op.apply_host_gathered(gathered, src)
            assert op.apply_host_scattered(scattered, src)
        assert gathered.equal(want) and scattered.equal(want)


def test_a_row_wider_than_half_the_stage_is_refused_and_moves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "HOST_STAGE_BYTES", 256)  # halves of 128 bytes
    [op] = plan_rows(np.arange(4), np.array([3, 0, 2, 1]))
    dst = torch.zeros(4, 256, dtype=torch.uint8)
    src = torch.ones(4, 256, dtype=torch.uint8)
    assert not op.apply_host_gathered(dst, src)
    assert not op.apply_host_scattered(dst, src)
    assert not dst.any()
    # Rows of exactly half the stage move, one a piece.
    narrow_dst, narrow_src = dst[:, :128].contiguous(), src[:, :128].contiguous()
    assert op.apply_host_gathered(narrow_dst, narrow_src) and narrow_dst.all()


def test_a_staged_move_refuses_a_sparse_span_and_moves_nothing() -> None:
    [op] = plan_rows(np.arange(4), np.array([0, 900, 17, 400]))
    dst = torch.zeros(4, 8, dtype=torch.uint8)
    assert not op.apply_staged(dst, torch.ones(1000, 8, dtype=torch.uint8))
    assert not dst.any()
    # The limit: a span of DEVICE_STAGE_MAX_SPAN times the rows read is taken.
    n, k = 2, transfer.DEVICE_STAGE_MAX_SPAN
    [taken] = plan_rows(np.arange(n), np.array([k * n - 1, 0]))
    [refused] = plan_rows(np.arange(n), np.array([k * n, 0]))
    src = torch.arange(k * n + 1, dtype=torch.uint8)[:, None].expand(-1, 8).contiguous()
    assert not refused.apply_staged(dst, src) and not dst.any()
    assert taken.apply_staged(dst, src) and dst[:n, 0].tolist() == [k * n - 1, 0]


def test_plan_rows_refuses_unparallel_inputs() -> None:
    with pytest.raises(ValueError, match=r"plan_rows: dst \(3,\) and src \(2,\) must be equal"):
        plan_rows(np.arange(3), np.arange(2))


def test_run_items_runs_every_item_once_over_lanes() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def item(i: int) -> None:
        with lock:
            seen.append(i)

    run_items([lambda i=i: item(i) for i in range(50)], 3, lambda: None)
    assert sorted(seen) == list(range(50))


def test_run_items_stops_every_lane_and_reraises_the_first_error() -> None:
    started = threading.Event()
    release = threading.Event()
    ran: list[int] = []

    def slow() -> None:
        started.set()
        assert release.wait(10)
        ran.append(0)

    def bad() -> None:
        assert started.wait(10)
        release.set()
        raise RuntimeError("plane 1 failed")

    items = [slow, bad] + [lambda: ran.append(1)] * 20
    with pytest.raises(RuntimeError, match="plane 1 failed"):
        run_items(items, 2, lambda: None)
    # The slow lane finished its item before run_items returned; few others ran.
    assert ran[0] == 0 and len(ran) < 21


def _lane_store(monkeypatch: pytest.MonkeyPatch, lanes: int) -> TierStore:
    monkeypatch.setattr(transfer, "LANE_MIN_BYTES", 0)  # every copy uses the lanes
    layout = small_layout()
    return TierStore(config(layout, cpu_blocks=40, copy_lanes=lanes))


def _planes(bufs: list[list[torch.Tensor]], slots: np.ndarray) -> list[torch.Tensor]:
    idx = torch.as_tensor(slots)
    return [t.index_select(0, idx).contiguous().view(torch.uint8) for g in bufs for t in g]


@pytest.mark.parametrize("style", ["runs", "pages", "tokens", "reversed"])
def test_lane_copies_round_trip_bit_exactly(monkeypatch: pytest.MonkeyPatch,
                                            style: str) -> None:
    st = _lane_store(monkeypatch, 3)
    layout = st.layout
    tpb = layout.tokens_per_block
    g = torch.Generator().manual_seed(9)
    bufs = [[torch.randint(0, 256, (256 * layout.row_bytes,), dtype=torch.uint8, generator=g)
             .view(layout.dtype.torch_dtype).view(256, layout.heads_per_rank, layout.head_size)
             for _ in range(layout.num_layers)] for _ in range(layout.kv_dim)]
    st.register_kv_buffers(0, bufs)
    rng = np.random.default_rng(5)
    n_blocks = 20
    if style == "runs":
        src = np.arange(8, 8 + n_blocks * tpb)
    elif style == "pages":
        src = (rng.permutation(32)[:n_blocks, None] * tpb + np.arange(tpb)).reshape(-1)
    elif style == "tokens":
        src = rng.permutation(128)[: n_blocks * tpb]
    else:
        src = np.arange(n_blocks * tpb)[::-1].copy()
    blocks = tuple(BlockLocation(Tier.CPU, b) for b in rng.permutation(40)[:n_blocks])
    st.execute(TransferPlan(Direction.STORE, blocks), src, timeout=10)
    dst = rng.permutation(np.arange(128, 256))[: n_blocks * tpb]
    st.execute(TransferPlan(Direction.LOAD, blocks), dst, timeout=10)
    for a, b in zip(_planes(bufs, src), _planes(bufs, dst), strict=True):
        assert a.equal(b)


def test_an_aborted_lane_copy_stops_every_lane_before_raising(
        monkeypatch: pytest.MonkeyPatch) -> None:
    st = _lane_store(monkeypatch, 2)
    layout = st.layout
    bufs = [[torch.zeros(64, layout.heads_per_rank, layout.head_size,
                         dtype=layout.dtype.torch_dtype) for _ in range(layout.num_layers)]
            for _ in range(layout.kv_dim)]
    st.register_kv_buffers(0, bufs)
    abort = threading.Event()
    calls: list[str] = []

    def hook(ev: threading.Event | None) -> None:
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            abort.set()  # set while another lane may be mid-plane

    st.copier.checkpoint_hook = hook
    blocks = tuple(BlockLocation(Tier.CPU, b) for b in range(4))
    with pytest.raises(CopyAborted):
        st.copy(TransferPlan(Direction.STORE, blocks),
                torch.arange(4 * layout.tokens_per_block), abort)
    n = len(calls)
    assert 2 <= n < layout.num_planes  # stopped early, each lane at its next check
    st.copier.checkpoint_hook = None
    assert len(calls) == n  # nothing runs after copy() raised


def test_copy_lanes_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"copy_lanes=0 is invalid; it must be an int >= 1"):
        EmbeddedBackendConfig(layout=small_layout(), cpu_bytes=1 << 20, copy_lanes=0)


def test_page_size_one_round_trip_and_bad_scattered_slots_write_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's page size 1 (one token per block), shuffled slots, lanes on: a round
    trip is bit-exact, and a shuffled mapping with one repeated slot is refused
    before any byte moves (then the same task still runs with good slots)."""
    monkeypatch.setattr(transfer, "LANE_MIN_BYTES", 0)
    layout = small_layout(tokens_per_block=1)
    b, [bufs] = started(config(layout, cpu_blocks=64, copy_lanes=2), num_slots=256)
    try:
        rng = np.random.default_rng(11)
        toks = tokens(48, seed=3)
        src = rng.permutation(128)[:48].astype(np.int64)
        store(b, toks, src)
        tid, mask = b.get_match(toks)
        bad = rng.permutation(np.arange(128, 256))[:48].astype(np.int64)
        bad[30] = bad[5]
        before = [t.clone() for g in bufs for t in g] + [b.store.cpu.pool.clone()]
        with pytest.raises(ValueError, match=rf"holds slot {bad[5]} 2 times"):
            b.launch([tid], [bad[mask]])
        after = [t for g in bufs for t in g] + [b.store.cpu.pool]
        assert all(x.view(torch.uint8).equal(y.view(torch.uint8))
                   for x, y in zip(before, after, strict=True))
        good = rng.permutation(np.arange(128, 256))[:48].astype(np.int64)
        [w] = b.launch([tid], [good[mask]])
        assert b.wait([w], timeout=10)[w].status.value == "success"
        for x, y in zip(_planes(bufs, src), _planes(bufs, good), strict=True):
            assert x.equal(y)
    finally:
        b.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize(("stride", "pages"), [(1, True), (3, True), (9, True), (9, False)])
def test_gpu_planes_round_trip_through_a_strided_pinned_tier(
        monkeypatch: pytest.MonkeyPatch, stride: int, pages: bool, mapped: bool) -> None:
    """CUDA engine planes stored into and loaded from every ``stride``-th block of a
    pinned tier: the loaded slots equal the stored ones bit for bit, through the GPU
    row kernel (``mapped``) and, with it off and stages of a few rows so that pieces
    alternate between the pinned halves many times, through the span transfer
    (stride 1 and 3) and the pinned stage (stride 9)."""
    from node_agent.backend import mapped_rows

    monkeypatch.setattr(mapped_rows, "ENABLED", mapped)
    from node_agent.backend.cpu_tier import CpuTier
    from node_agent.backend.planes import register_buffers
    from node_agent.backend.transfer import BlockCopier
    from node_agent.vocab.placement import block_locations

    layout = small_layout()
    tpb = layout.tokens_per_block
    n_blocks = 24
    n = n_blocks * tpb
    monkeypatch.setattr(transfer, "HOST_STAGE_BYTES", 8 * tpb * layout.row_elems * 2)
    monkeypatch.setattr(transfer, "DEVICE_STAGE_BYTES", 3 * tpb * layout.row_elems * 2)
    tier = CpuTier(layout, stride * n_blocks, pinned=True)
    assert tier.pool.is_pinned()
    shape = (3 * n, layout.heads_per_rank, layout.head_size)
    g = torch.Generator(device="cuda").manual_seed(stride)
    bufs = [[torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
             for _ in range(layout.num_layers)] for _ in range(2)]
    regs = {0: register_buffers(layout, 0, bufs)}
    copier = BlockCopier(layout, tier, None)
    rng = np.random.default_rng(stride)
    if pages:
        order = rng.permutation(n_blocks)
        src = (order[:, None] * tpb + np.arange(tpb)).reshape(-1)
        dst = ((rng.permutation(2 * n_blocks)[:n_blocks] + n_blocks)[:, None] * tpb
               + np.arange(tpb)).reshape(-1)
    else:
        src, dst = rng.permutation(n), n + rng.permutation(2 * n)[:n]
    blocks = list(range(0, stride * n_blocks, stride))
    copier.store(regs, blocks, torch.as_tensor(src))
    copier.load(regs, block_locations(Tier.CPU, blocks), torch.as_tensor(dst))
    s_idx, d_idx = torch.as_tensor(src, device="cuda"), torch.as_tensor(dst, device="cuda")
    for plane in regs[0].planes:
        assert torch.equal(plane[d_idx], plane[s_idx])


"""Row ops on CPU tensors: every slot pattern (runs of every length, reverse
order, single slots, gaps, both sides scattered) moves exactly the named rows,
bit for bit, against a plain ``index_select`` reference, on contiguous rows
(scatters through the numpy row kernel) and on strided rows (torch ops alike);
an op whose rows do not fit the tensors moves nothing. A plan of several ops
runs as one fused kernel call with the library (same bytes, same refusals)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from node_agent.backend import row_kernel
from node_agent.backend.slots import validate_slot_mapping
from node_agent.backend.transfer import OpKind, RowOp, RowPlan, plan_rows

ROW_BYTES = 40  # not a multiple of 16: rows are copied as bytes, never as wider elements


def _runs(rng: np.random.Generator, n: int, max_run: int) -> np.ndarray:
    """``n`` distinct rows made of runs of 1..``max_run`` consecutive rows, each run
    at a random gap after the previous one."""
    out, at = [], 0
    while sum(len(r) for r in out) < n:
        k = int(rng.integers(1, max_run + 1))
        at += int(rng.integers(0, 4))
        out.append(np.arange(at, at + k))
        at += k
    return np.concatenate(out)[:n].astype(np.int64)


def _pattern(kind: str, rng: np.random.Generator, n: int) -> np.ndarray:
    if kind == "runs":
        return _runs(rng, n, int(rng.integers(1, 70)))
    if kind == "shuffled_runs":
        runs = _runs(rng, n, int(rng.integers(2, 30)))
        starts = np.flatnonzero(np.diff(runs, prepend=-2) != 1)
        pieces = np.split(runs, starts[1:])
        return np.concatenate([pieces[i] for i in rng.permutation(len(pieces))])
    if kind == "reversed":
        return _runs(rng, n, 64)[::-1].copy()
    if kind == "singles":
        return rng.permutation(3 * n)[:n].astype(np.int64)
    assert kind == "dense"
    return np.arange(5, 5 + n, dtype=np.int64)


def _random_rows(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, ROW_BYTES), dtype=torch.uint8, generator=g)


def _reference(dst: torch.Tensor, src: torch.Tensor, d: np.ndarray, s: np.ndarray,
               ) -> torch.Tensor:
    want = dst.clone()
    want.index_copy_(0, torch.from_numpy(d), src.index_select(0, torch.from_numpy(s)))
    return want


KINDS = ["runs", "shuffled_runs", "reversed", "singles", "dense"]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dst_kind", KINDS)
@pytest.mark.parametrize("src_kind", KINDS)
def test_every_pattern_is_bit_exact_on_both_paths(seed: int, dst_kind: str,
                                                  src_kind: str) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    d = _pattern(dst_kind, rng, n)
    s = _pattern(src_kind, rng, n)
    ops = plan_rows(d, s)
    src = _random_rows(int(s.max()) + 1, seed)
    dst = _random_rows(int(d.max()) + 3, seed + 100)
    want = _reference(dst, src, d, s)
    # Contiguous rows: scatters and general ops run the numpy row kernel.
    assert row_kernel.row_array(dst) is not None and row_kernel.row_array(src) is not None
    fast = dst.clone()
    for op in ops:
        op.apply(fast, src)
    assert fast.equal(want)
    # The same rows as strided views (every other row of a wider tensor): torch ops.
    wide_dst = torch.zeros(2 * dst.shape[0], ROW_BYTES, dtype=torch.uint8)
    wide_dst[::2] = dst
    wide_src = torch.zeros(2 * src.shape[0], ROW_BYTES, dtype=torch.uint8)
    wide_src[::2] = src
    assert row_kernel.row_array(wide_dst[::2]) is None
    for op in ops:
        op.apply(wide_dst[::2], wide_src[::2])
    assert wide_dst[::2].equal(want) and not wide_dst[1::2].any()


def test_every_op_kind_runs_through_the_kernel() -> None:
    """One pattern per kind, so a kind the planner stops choosing still gets checked."""
    rng = np.random.default_rng(7)
    cases = {
        OpKind.SLICE: (np.arange(10, 90), np.arange(200, 280)),
        OpKind.GATHER: (np.arange(80), rng.permutation(300)[:80]),
        OpKind.SCATTER: (rng.permutation(300)[:80], np.arange(80)),
        OpKind.GENERAL: (rng.permutation(300)[:80], rng.permutation(300)[:80]),
    }
    for kind, (d, s) in cases.items():
        ops = plan_rows(d, s)
        assert {op.kind for op in ops} == {kind}
        src, dst = _random_rows(300, 1), _random_rows(300, 2)
        want = _reference(dst, src, d.astype(np.int64), s.astype(np.int64))
        for op in ops:
            op.apply(dst, src)
        assert dst.equal(want), kind


def test_staging_grows_and_is_reused_across_sizes() -> None:
    """General ops of growing, then shrinking, sizes on one thread stay exact."""
    rng = np.random.default_rng(3)
    for n in (5, 700, 40, 1500, 3):
        d = rng.permutation(4 * n)[:n]
        s = rng.permutation(4 * n)[:n]
        [op] = plan_rows(d, s, max_ops=1)
        assert op.kind is OpKind.GENERAL
        src, dst = _random_rows(4 * n, n), _random_rows(4 * n, n + 1)
        want = _reference(dst, src, d.astype(np.int64), s.astype(np.int64))
        op.apply(dst, src)
        assert dst.equal(want)


@pytest.mark.parametrize("kind", ["gather", "scatter", "slice"])
def test_rows_outside_the_tensors_move_nothing(kind: str) -> None:
    if kind == "gather":
        op = RowOp(OpKind.GATHER, dst_start=0, length=3, src_index=np.array([1, 50, 2]))
    elif kind == "scatter":
        op = RowOp(OpKind.SCATTER, src_start=0, length=3, dst_index=np.array([1, 50, 2]))
    else:
        op = RowOp(OpKind.SLICE, dst_start=0, src_start=45, length=10)
    src, dst = _random_rows(20, 1), _random_rows(20, 2)
    before = dst.clone()
    with pytest.raises(IndexError, match=r"needs \d+ destination and \d+ source rows, but the "
                                         r"tensors hold 20 and 20"):
        op.apply(dst, src)
    assert dst.equal(before)


def test_negative_rows_are_refused_when_planned() -> None:
    with pytest.raises(ValueError, match="src index holds negative row -4"):
        RowOp(OpKind.GATHER, length=2, src_index=np.array([3, -4]))


def test_rows_of_different_widths_are_refused_before_any_byte_moves() -> None:
    [op] = plan_rows(np.arange(4), np.array([3, 1, 0, 2]))
    dst = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"destination rows are torch.uint8 x \(8,\) but "
                                         r"source rows are torch.uint8 x \(16,\)"):
        op.apply(dst, torch.ones(4, 16, dtype=torch.uint8))
    assert dst.shape == (4, 8) and not dst.any()


def test_duplicate_slots_are_refused_before_any_plan() -> None:
    with pytest.raises(ValueError, match="holds slot 7 2 times"):
        validate_slot_mapping(np.array([3, 7, 1, 7]), 4, 16)


def test_staging_serves_rows_of_another_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread's staging buffer grown for 40-byte rows serves 64-byte rows next (two
    stages of different layouts on one worker thread): exact, no dtype error."""
    monkeypatch.setattr(row_kernel, "_native", None)
    monkeypatch.setattr(row_kernel, "NATIVE", False)
    monkeypatch.setattr(row_kernel._local, "stage", None, raising=False)
    rng = np.random.default_rng(12)
    for width, n in ((40, 9), (64, 5), (40, 3)):  # 360 staged bytes, then 320, then 120
        src = torch.randint(0, 256, (4 * n, width), dtype=torch.uint8)
        dst = torch.randint(0, 256, (4 * n, width), dtype=torch.uint8)
        d = rng.permutation(4 * n)[:n].astype(np.int64)
        s = rng.permutation(4 * n)[:n].astype(np.int64)
        [op] = plan_rows(d, s, max_ops=1)
        assert op.kind is OpKind.GENERAL
        want = _reference(dst, src, d, s)
        op.apply(dst, src)
        assert dst.equal(want)


def test_a_move_larger_than_the_staging_cap_goes_in_pieces_and_stays_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A general move of more bytes than a thread may keep is staged piece by piece
    (here a cap of 7 rows, with a last partial piece): bit-exact, and the thread
    keeps no more staging than the cap."""
    from node_agent.backend import row_kernel

    rng = np.random.default_rng(11)
    n = 100
    src, dst = _random_rows(4 * n, 6), _random_rows(4 * n, 7)
    row_bytes = src[0].numel() * src.element_size()
    monkeypatch.setattr(row_kernel, "_native", None)  # staging is the numpy kernel's
    monkeypatch.setattr(row_kernel, "NATIVE", False)
    monkeypatch.setattr(row_kernel, "STAGING_MAX_BYTES", 7 * row_bytes)
    monkeypatch.setattr(row_kernel._local, "stage", None, raising=False)
    d, s = rng.permutation(4 * n)[:n], rng.permutation(4 * n)[:n]
    [op] = plan_rows(d, s, max_ops=1)
    assert op.kind is OpKind.GENERAL
    want = _reference(dst, src, d.astype(np.int64), s.astype(np.int64))
    op.apply(dst, src)
    assert dst.equal(want)
    assert len(row_kernel._local.stage) == 7 * row_bytes




NEEDS_LIBRARY = pytest.mark.skipif(
    not row_kernel.NATIVE, reason="the _rowcopy library is not built here (reinstall the "
    "package with a C compiler: pip install -e .)")


@pytest.fixture(params=["library", "library-sse2", "library-memcpy", "numpy"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the streaming-store library at each level this CPU runs
    (its best, SSE2, plain ``memcpy``) and with numpy."""
    param = str(request.param)
    if param.startswith("library"):
        lib = row_kernel._native
        if lib is None:
            pytest.skip("the _rowcopy library is not built here (reinstall the package "
                        "with a C compiler: pip install -e .)")
        cap = ctypes.c_int.in_dll(lib, "rowcopy_max_level")
        want = {"library": -1, "library-sse2": 1, "library-memcpy": 0}[param]
        if want > 0 and lib.rowcopy_level() < want:
            pytest.skip(f"this CPU has no level {want} copy")
        old = cap.value
        cap.value = want
        request.addfinalizer(lambda: setattr(cap, "value", old))
        if want >= 0:
            assert lib.rowcopy_level() == want
    else:
        monkeypatch.setattr(row_kernel, "_native", None)
        monkeypatch.setattr(row_kernel, "NATIVE", False)
    return param


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dst_kind", KINDS)
@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("row_bytes", [40, 64, 2048])
def test_both_kernels_are_bit_exact_for_every_pattern(kernel: str, seed: int, dst_kind: str,
                                                      src_kind: str, row_bytes: int) -> None:
    """Rows of 40 bytes (copied with ``memcpy``), 64 and 2048 bytes (streaming stores
    where the destination is aligned), every slot pattern, against torch indexing."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    d = _pattern(dst_kind, rng, n)
    s = _pattern(src_kind, rng, n)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (int(s.max()) + 1, row_bytes), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (int(d.max()) + 3, row_bytes), dtype=torch.uint8, generator=g)
    want = _reference(dst, src, d, s)
    for op in plan_rows(d, s):
        op.apply(dst, src)
    assert dst.equal(want)


@pytest.mark.parametrize("offset", [8, 16])
def test_the_library_writes_rows_at_unaligned_destinations(kernel: str, offset: int) -> None:
    """A destination row not aligned for the streaming stores (128-byte rows from
    byte 8, or byte 16 of a buffer: aligned for SSE2, not for AVX2) is copied with
    ``memcpy`` and stays exact; nothing outside the rows is written."""
    rng = np.random.default_rng(9)
    raw_dst = torch.zeros(128 * 100 + offset, dtype=torch.uint8)
    dst = raw_dst[offset:].view(100, 128)
    src = torch.randint(0, 256, (300, 128), dtype=torch.uint8)
    d, s = rng.permutation(100)[:60].astype(np.int64), rng.permutation(300)[:60].astype(np.int64)
    for kind_d, kind_s in ((np.arange(60), s), (d, np.arange(60)), (d, s),
                           (np.arange(30, 90), np.arange(200, 260))):  # one slice
        dst.zero_()
        want = _reference(dst, src, kind_d.astype(np.int64), kind_s)
        for op in plan_rows(kind_d, kind_s):
            op.apply(dst, src)
        assert dst.equal(want) and not raw_dst[:offset].any()


def test_overlapping_arrays_are_left_to_numpy() -> None:
    """Rows moved within one tensor are not given to the library (it assumes the two
    sides apart); numpy's result matches torch indexing."""
    t = torch.randint(0, 256, (200, 64), dtype=torch.uint8)
    rows = row_kernel.row_array(t)
    assert rows is not None
    assert not row_kernel._use_native(rows, rows, np.arange(3, dtype=np.int64))
    d = np.random.default_rng(4).permutation(np.arange(100, 150)).astype(np.int64)
    want = t.clone()
    want[torch.from_numpy(d)] = t[120:170].clone()
    row_kernel.scatter(rows, d, rows, 120)  # source rows 120..169 overlap the destination
    assert t.equal(want)
    g = np.arange(110, 160, dtype=np.int64)[::-1].copy()
    want2 = t.clone()
    want2[130:180] = t[torch.from_numpy(g)].clone()
    row_kernel.gather(rows, 130, rows, g)
    assert t.equal(want2)
    for d0, s0 in ((40, 10), (10, 40)):  # overlapping runs, moved forward and back
        want3 = t.clone()
        want3[d0:d0 + 60] = t[s0:s0 + 60].clone()
        row_kernel.copy_run(rows, d0, rows, s0, 60)
        assert t.equal(want3)


@NEEDS_LIBRARY
def test_the_library_is_loaded_unless_numpy_is_asked_for(tmp_path: object) -> None:
    """``FLEXKV_ROW_KERNEL=numpy`` turns the library off in a fresh process."""
    import os
    import subprocess
    import sys

    code = "from node_agent.backend import row_kernel; print(row_kernel.NATIVE)"
    for env, want in (({}, "True"), ({"FLEXKV_ROW_KERNEL": "numpy"}, "False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, **env}, check=True)
        assert out.stdout.strip() == want


KERNEL_OF = {OpKind.SCATTER: "scatter", OpKind.GENERAL: "gather_scatter",
             OpKind.GATHER: "gather"}


@pytest.mark.parametrize("kind", list(OpKind))
def test_each_kind_takes_its_path_bit_exact_for_bf16_nan_payloads(
        kind: OpKind, kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between contiguous CPU rows scatters and general ops run the row kernel,
    gathers too when the library is loaded (torch's gather is as fast as numpy's),
    slices torch; strided rows never reach the kernel; every path is
    bit-exact against torch indexing for bf16 rows of random bits (NaNs with
    payloads, infinities, subnormals, -0.0), whose values a float copy could
    change."""
    calls: list[str] = []
    for name in KERNEL_OF.values():
        real = getattr(row_kernel, name)

        def counted(*args: object, _real: object = real, _name: str = name) -> None:
            calls.append(_name)
            _real(*args)  # type: ignore[operator]
        monkeypatch.setattr(row_kernel, name, counted)
    rng = np.random.default_rng(5)
    d, s = {
        OpKind.SLICE: (np.arange(30, 230), np.arange(7, 207)),
        OpKind.GATHER: (np.arange(200), rng.permutation(600)[:200]),
        OpKind.SCATTER: (rng.permutation(600)[:200], np.arange(200)),
        OpKind.GENERAL: (rng.permutation(600)[:200], rng.permutation(600)[:200]),
    }[kind]
    d, s = d.astype(np.int64), s.astype(np.int64)
    [op] = plan_rows(d, s, max_ops=1)
    assert op.kind is kind
    src = _random_rows(600, 21).view(torch.bfloat16).view(600, -1)
    dst = _random_rows(600, 22).view(torch.bfloat16).view(600, -1)
    assert bool(src.isnan().any())
    orig = dst.clone()
    want = _reference(dst.view(torch.uint8), src.view(torch.uint8), d, s)
    op.apply(dst, src)
    kernel_kinds = {OpKind.SCATTER, OpKind.GENERAL} | (
        {OpKind.GATHER} if kernel.startswith("library") else set())
    assert calls == ([KERNEL_OF[kind]] if kind in kernel_kinds else [])
    assert dst.view(torch.uint8).equal(want)
    calls.clear()
    wide_src = torch.zeros(1200, src.shape[1], dtype=torch.bfloat16)
    wide_src[::2] = src
    wide_dst = torch.zeros(1200, src.shape[1], dtype=torch.bfloat16)
    wide_dst[::2] = orig
    op.apply(wide_dst[::2], wide_src[::2])
    assert calls == []
    assert wide_dst[::2].contiguous().view(torch.uint8).equal(want)


def test_a_run_outside_its_array_or_unpaired_indices_move_nothing(kernel: str) -> None:
    """The kernel's own entry points refuse a slice run past an array's end and
    indices of different lengths before any byte moves, whichever kernel runs (the
    library would copy past the array where numpy refused the shape)."""
    src_t = torch.arange(8 * 64, dtype=torch.int64).reshape(8, 64).to(torch.uint8)
    dst_t = torch.zeros(6, 64, dtype=torch.uint8)
    src, dst = row_kernel.row_array(src_t), row_kernel.row_array(dst_t)
    assert src is not None and dst is not None
    before = dst_t.clone()
    four = np.arange(4, dtype=np.int64)
    with pytest.raises(IndexError, match=r"gather destination rows 3\.\.7 lie outside its 6 rows"):
        row_kernel.gather(dst, 3, src, four)
    with pytest.raises(IndexError, match=r"scatter source rows 6\.\.10 lie outside its 8 rows"):
        row_kernel.scatter(dst, four, src, 6)
    with pytest.raises(ValueError, match="3 destination rows for 4 source rows"):
        row_kernel.gather_scatter(dst, np.arange(3, dtype=np.int64), src, four)
    with pytest.raises(IndexError, match=r"run destination rows 3\.\.7 lie outside its 6 rows"):
        row_kernel.copy_run(dst, 3, src, 0, 4)
    with pytest.raises(IndexError, match=r"run source rows 5\.\.9 lie outside its 8 rows"):
        row_kernel.copy_run(dst, 0, src, 5, 4)
    with pytest.raises(IndexError, match=r"run source rows -1\.\.3 lie outside its 8 rows"):
        row_kernel.copy_run(dst, 0, src, -1, 4)
    assert dst_t.equal(before)
    row_kernel.copy_run(dst, 2, src, 4, 4)  # the largest run that fits
    assert dst_t[2:6].equal(src_t[4:8]) and dst_t[:2].equal(before[:2])
    dst_t.copy_(before)
    row_kernel.gather(dst, 2, src, four)  # the largest run that fits
    assert dst_t[2:6].equal(src_t[:4])


def _pages(n_blocks: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A paged load: ``n_blocks`` scattered engine pages fed from scattered tier
    pages (one single-page slice op per page without fusing)."""
    d = 2 * rng.permutation(2 * n_blocks)[:n_blocks].astype(np.int64)  # no two adjacent
    s = 2 * rng.permutation(n_blocks).astype(np.int64)
    return d, s


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dst_kind", [*KINDS, "pages"])
@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("row_bytes", [40, 64, 2048])
def test_plans_are_bit_exact_fused_or_op_by_op(kernel: str, seed: int, dst_kind: str,
                                               src_kind: str, row_bytes: int) -> None:
    """A :class:`RowPlan` moves exactly the named rows whichever way it runs: fused
    into one general op (library, several ops), op by op (numpy, or one op), and on
    strided rows (never fused), against torch indexing."""
    rng = np.random.default_rng(seed)
    if dst_kind == "pages":
        d, s = _pages(int(rng.integers(2, 40)), rng)
    else:
        n = int(rng.integers(1, 300))
        d, s = _pattern(dst_kind, rng, n), _pattern(src_kind, rng, n)
    ops = plan_rows(d, s)
    plan = RowPlan(ops)
    assert (plan.fused is not None) == (kernel != "numpy" and len(ops) > 1)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (int(s.max()) + 1, row_bytes), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (int(d.max()) + 3, row_bytes), dtype=torch.uint8, generator=g)
    want = _reference(dst, src, d, s)
    wide_dst = torch.zeros(dst.shape[0], 2 * row_bytes, dtype=torch.uint8)
    wide_dst[:, :row_bytes] = dst
    plan.apply(dst, src)
    assert dst.equal(want)
    plan.apply(wide_dst[:, :row_bytes], src)  # strided rows: op by op
    assert wide_dst[:, :row_bytes].equal(want) and not wide_dst[:, row_bytes:].any()


@NEEDS_LIBRARY
def test_a_plan_of_page_slices_is_one_kernel_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scattered whole pages (vLLM's paged layout) plan as one slice per page; with
    the library the plan moves them in one ``gather_scatter`` call, bit-exact for bf16
    rows of random bits."""
    calls: list[int] = []
    real = row_kernel.gather_scatter

    def counted(dst: np.ndarray, di: np.ndarray, src: np.ndarray, si: np.ndarray) -> None:
        calls.append(len(di))
        real(dst, di, src, si)
    monkeypatch.setattr(row_kernel, "gather_scatter", counted)
    d, s = _pages(12, np.random.default_rng(3))
    ops = plan_rows(d, s)
    assert len(ops) == 12 and {op.kind for op in ops} == {OpKind.SLICE}
    plan = RowPlan(ops)
    src = _random_rows(24, 31).view(torch.bfloat16).view(24, -1)
    dst = _random_rows(48, 32).view(torch.bfloat16).view(48, -1)
    want = _reference(dst.view(torch.uint8), src.view(torch.uint8), d, s)
    plan.apply(dst, src)
    assert calls == [12]
    assert dst.view(torch.uint8).equal(want)


def test_a_fused_plan_refuses_rows_outside_the_tensors_or_other_widths(kernel: str) -> None:
    """A plan checks all its rows against both tensors, and their row dtype and
    width, before any byte moves, fused or op by op (ops before the one that does
    not fit move nothing either)."""
    d, s = _pages(10, np.random.default_rng(4))
    plan = RowPlan(plan_rows(d, s))
    src = _random_rows(int(s.max()) + 1, 41)
    dst = _random_rows(int(d.max()), 42)  # one row short of the highest page
    before = dst.clone()
    with pytest.raises(IndexError, match=r"needs \d+ destination and \d+ source rows, but the "
                                         r"tensors hold"):
        plan.apply(dst, src)
    assert dst.equal(before)
    dst = _random_rows(int(d.max()) + 1, 43)
    before = dst.clone()
    with pytest.raises(ValueError, match=r"destination rows are torch.uint8 x \(40,\) but "
                                         r"source rows are torch.uint8 x \(80,\)"):
        plan.apply(dst, torch.zeros(int(s.max()) + 1, 80, dtype=torch.uint8))
    assert dst.equal(before)

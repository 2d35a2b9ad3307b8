"""The GPU row kernel (node_agent.backend.mapped_rows): rows moved between CUDA
memory and pinned host memory by one launch, bit for bit, in either direction and
with either side indexed; and every case where it must not run moves nothing and
says so (False), so that the staged moves take over.

The CUDA cases run on a GPU host (scripts/gpu_check.sh); elsewhere they skip."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from node_agent.backend import mapped_rows
from node_agent.backend.transfer import OpKind, RowOp, RowPlan, plan_rows

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _index_never_asked(asked: list[str], which: str) -> Callable[[], torch.Tensor]:
    def get() -> torch.Tensor:
        asked.append(which)
        return torch.arange(3)
    return get


def test_two_host_tensors_are_not_moved_by_the_kernel() -> None:
    """Nothing moves, and no index is asked for (none is uploaded for nothing)."""
    src = torch.arange(40, dtype=torch.uint8).view(10, 4)
    dst = torch.zeros(10, 4, dtype=torch.uint8)
    asked: list[str] = []
    assert not mapped_rows.move_rows(dst, _index_never_asked(asked, "dst"), 0,
                                     src, _index_never_asked(asked, "src"), 0, 3)
    assert int(dst.count_nonzero()) == 0 and asked == []


def test_switched_off_the_kernel_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapped_rows, "ENABLED", False)
    src = torch.ones(4, 8)
    dst = torch.zeros(4, 8)
    asked: list[str] = []
    assert not mapped_rows.move_rows(dst, None, 0, src, _index_never_asked(asked, "src"), 0, 4)
    assert int(dst.count_nonzero()) == 0 and asked == []


def test_rows_that_are_not_contiguous_are_refused() -> None:
    t = torch.zeros(6, 8)
    assert mapped_rows._byte_rows(t.t()) is None
    assert mapped_rows._byte_rows(t.view(2, 3, 8)) is None
    got = mapped_rows._byte_rows(t[:, 2:6])
    assert got is not None
    raw, stride, width = got
    assert (stride, width) == (32, 16) and raw.dtype == torch.uint8


def _rows(n: int, width: int, dtype: torch.dtype, pad: int, device: str, pinned: bool,
          seed: int) -> torch.Tensor:
    """``n`` random rows of ``width`` elements, each ``pad`` elements apart from the next."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, 256, (n, (width + pad) * torch.empty(0, dtype=dtype).element_size()),
                         dtype=torch.uint8, generator=g).view(dtype)
    if device == "cuda":
        full = full.cuda()
    elif pinned:
        full = full.pin_memory()
    return full[:, :width]


@cuda
@pytest.mark.parametrize("to_device", [True, False])
@pytest.mark.parametrize("indexed", ["both", "src", "dst"])
@pytest.mark.parametrize(("width", "dtype", "pad"), [
    (1024, torch.bfloat16, 0),  # one token of a Llama-3-8B plane (2 KiB)
    (16384, torch.bfloat16, 0),  # a 16-token page (32 KiB: several programs per row)
    (3, torch.uint8, 5),  # odd width, rows 8 bytes apart
    (100, torch.float32, 28),  # rows wider apart than they are wide
])
def test_cuda_rows_move_bit_for_bit(to_device: bool, indexed: str, width: int,
                                    dtype: torch.dtype, pad: int) -> None:
    rng = np.random.default_rng(width)
    n_src, n_dst, n = 96, 128, 64
    src = _rows(n_src, width, dtype, pad, "cpu" if to_device else "cuda", True, 1)
    dst = _rows(n_dst, width, dtype, pad, "cuda" if to_device else "cpu", True, 2)
    before = dst.clone()
    s_rows = rng.permutation(n_src)[:n] if indexed in ("both", "src") else None
    d_rows = rng.permutation(n_dst)[:n] if indexed in ("both", "dst") else None
    s_all = s_rows if s_rows is not None else np.arange(5, 5 + n)
    d_all = d_rows if d_rows is not None else np.arange(9, 9 + n)
    on = torch.device("cuda", torch.cuda.current_device())
    assert mapped_rows.move_rows(
        dst, None if d_rows is None else torch.as_tensor(d_rows, device=on), 9,
        src, None if s_rows is None else torch.as_tensor(s_rows, device=on), 5, n)
    torch.cuda.synchronize()
    want = before.clone()
    want[torch.as_tensor(d_all, device=want.device)] = src[
        torch.as_tensor(s_all, device=src.device)].to(want.device)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


@cuda
def test_cuda_unpinned_host_rows_are_left_to_the_staged_moves() -> None:
    src = torch.ones(32, 256, dtype=torch.uint8)
    dst = torch.zeros(32, 256, dtype=torch.uint8, device="cuda")
    idx = torch.arange(32, device="cuda")
    assert not mapped_rows.move_rows(dst, idx, 0, src, idx, 0, 32)
    assert not mapped_rows.move_rows(src, idx, 0, dst, idx, 0, 32)
    torch.cuda.synchronize()
    assert int(dst.count_nonzero()) == 0 and int(src.sum()) == 32 * 256


@cuda
def test_cuda_rows_beyond_two_gib_of_host_memory() -> None:
    """Row offsets are 64-bit: the last rows of a pinned host tensor larger than
    2 GiB are read and written where they are."""
    width = 4096
    n_rows = (1 << 31) // width + 64
    host = torch.empty(n_rows, width, dtype=torch.uint8, pin_memory=True)
    far = torch.arange(n_rows - 8, n_rows, device="cuda")
    dev = torch.randint(0, 256, (8, width), dtype=torch.uint8, device="cuda")
    assert mapped_rows.move_rows(host, far, 0, dev, None, 0, 8)
    back = torch.zeros_like(dev)
    assert mapped_rows.move_rows(back, None, 0, host, far, 0, 8)
    torch.cuda.synchronize()
    assert torch.equal(host[-8:].cuda(), dev) and torch.equal(back, dev)


@cuda
def test_cuda_a_plan_of_page_slices_is_one_kernel_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A load of a few scattered whole pages plans several ops (slices of pages);
    between a pinned tier and CUDA the whole plan is one launch, and with the
    kernel off the same plan moves the same bytes op by op."""
    rng = np.random.default_rng(3)
    pages, tpb = 10, 16  # fewer runs than MAX_SEGMENTS: slices, not one general op
    src_pages = rng.permutation(pages)
    dst_pages = rng.permutation(2 * pages)[:pages]
    src_rows = (src_pages[:, None] * tpb + np.arange(tpb)).reshape(-1)
    dst_rows = (dst_pages[:, None] * tpb + np.arange(tpb)).reshape(-1)
    plan = RowPlan(plan_rows(dst_rows, src_rows))
    assert len(plan.ops) > 1 and OpKind.SLICE in {op.kind for op in plan.ops}
    tier = _rows(pages * tpb, 512, torch.bfloat16, 0, "cpu", True, 4)
    launches: list[int] = []
    real = mapped_rows.move_rows

    def counted(*args: object) -> bool:
        launches.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(mapped_rows, "move_rows", counted)
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(mapped_rows, "ENABLED", enabled)
        launches.clear()
        dst = torch.zeros(2 * pages * tpb, 512, dtype=torch.bfloat16, device="cuda")
        plan.apply(dst, tier)
        torch.cuda.synchronize()
        results.append((dst, len(launches)))
    (on, n_on), (off, _) = results
    assert n_on == 1
    want = torch.zeros_like(on)
    want[torch.as_tensor(dst_rows, device="cuda")] = tier[torch.as_tensor(src_rows)].cuda()
    # Random bytes hold NaNs: compare bytes, not values.
    assert torch.equal(on.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(off.view(torch.uint8), want.view(torch.uint8))


@cuda
def test_cuda_a_slice_stays_one_copy_engine_transfer() -> None:
    op = RowOp(OpKind.SLICE, dst_start=2, src_start=1, length=4)
    src = _rows(8, 64, torch.float16, 0, "cpu", True, 5)
    dst = torch.zeros(8, 64, dtype=torch.float16, device="cuda")
    assert not op.apply_mapped(dst, src)
    op.apply(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst[2:6].cpu().view(torch.uint8), src[1:5].view(torch.uint8))


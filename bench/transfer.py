"""Store / load bandwidth through the embedded backend versus plain copies of the same bytes.

A Llama-3-8B-shaped stage (32 layers, 8 KV heads of 128, bf16, 16 tokens per
block: 128 KiB per token) on CPU tensors. Rows (one JSON object each):

* ``cpu_store`` / ``cpu_load``: ``launch``+``wait`` of a matched put (resp.
  get) of ``--tokens`` tokens against the CPU tier, versus ``dst.copy_(src)``
  of the same number of bytes, interleaved round by round (``--cpu-rounds``);
  ``ratio`` is the median of the per-round ratios (every one is listed in
  ``round_ratios``, with the load average); ``cpu_ratio`` is the same
  median over process CPU seconds (every thread of the process: the copy
  lanes, the workers, torch's own threads), which a loaded machine disturbs
  far less than wall-clock time (more threads win a larger share of busy cores
  without moving bytes faster): with both sides keeping both cores busy it
  reads close to, a few hundredths above, the quiet-machine wall ratio. Once with slot mappings of
  shuffled aligned pages (``slots: pages``, SGLang's allocation with
  ``page_size == tokens_per_block``; goal ratio >= 0.9), once with shuffled
  single slots (``slots: tokens``, SGLang's page size 1; goal >= 0.8), and
  once with single slots spread over twice as many (``slots: sparse``, a
  fragmented page-size-1 pool: loads become scatters; goal >= 0.8).
* ``gpu_store`` / ``gpu_load`` (``--engine-device cuda``, a GPU host): the same
  rounds with the engine's KV buffers on the GPU and the CPU tier in pinned
  memory, versus one ``copy_`` of the same bytes between a GPU tensor and a
  pinned host tensor (the copy engine's best case), each followed by a device
  synchronise.
* ``--tier-stride K``: ``{cpu,gpu}_store_strided`` / ``..._load_strided`` rows
  copy through the stage's block copier into and out of every K-th block of the
  CPU tier (a fragmented tier, where a prompt's blocks are far apart) with
  shuffled aligned pages on the engine side, against the same flat copies.
  ``--direct`` runs every row with the plain torch ops instead of the GPU row
  kernel and the staged host <-> device moves (``transfer.DEVICE_STAGING =
  False``), ``--no-mapped`` with the staged moves but not the kernel
  (``mapped_rows.ENABLED = False``): the befores, for a same-machine
  comparison. Rows with CUDA engine buffers name the path in ``path``.
* ``ssd_spill``: the ``put_match`` that spills ``--tokens`` tokens of CPU
  blocks to the SSD tier, versus one ``os.pwrite`` of the same bytes to a file
  in the same directory.
* ``ssd_load``: loading SSD-resident blocks into engine slots, versus
  ``os.preadv`` of the same bytes from a file in the same directory. With page
  slot mappings and CPU engine buffers the backend reads straight into the
  engine's pages (one ``preadv`` per block).

The SSD rows run in whatever the directory is backed by (page cache included),
and so do their baselines. Run: ``python bench/transfer.py [--tokens N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from node_agent.backend import mapped_rows, transfer
from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.cpu_tier import CpuTier
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.planes import register_buffers
from node_agent.backend.transfer import BlockCopier
from node_agent.vocab.layout import KVDtype, KVLayout
from node_agent.vocab.placement import Tier, block_locations

GIB = 1024**3


def _best(fn: Callable[[], float], repeat: int) -> float:
    """Fastest of ``repeat`` runs of ``fn`` (which returns its own duration), after one
    warm-up run; the same rule for the backend and the baselines keeps noise out."""
    fn()
    return min(fn() for _ in range(repeat))


Clocked = tuple[float, float]
"""Wall-clock seconds and process CPU seconds of one call."""


def _paired(fn: Callable[[], Clocked], base: Callable[[], Clocked], repeat: int,
            ) -> tuple[list[Clocked], list[Clocked]]:
    """``repeat`` rounds of ``fn`` and ``base`` (after one warm-up each), interleaved
    round by round (which goes first alternates) so that both see the same
    background load on a shared machine; returns both lists of durations."""
    fn()
    base()
    a, b = [], []
    for r in range(repeat):
        if r % 2:
            b.append(base())
            a.append(fn())
        else:
            a.append(fn())
            b.append(base())
    return a, b


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _clocked(fn: Callable[[], object]) -> Clocked:
    """Wall-clock and process CPU seconds of one call of ``fn``."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _row(name: str, nbytes: int, seconds: float, base_seconds: float, goal: float | None,
         **extra: object) -> None:
    gbps = nbytes / seconds / 1e9
    base = nbytes / base_seconds / 1e9
    row: dict[str, object] = {
        "bench": "transfer", "row": name, "bytes": nbytes, "gb_per_s": round(gbps, 3),
        "baseline_gb_per_s": round(base, 3), "ratio": round(gbps / base, 3),
    }
    if goal is not None:
        row["goal_ratio"] = goal
        row["goal_met"] = gbps / base >= goal
    row.update(extra)
    print(json.dumps(row), flush=True)


def _paired_row(name: str, nbytes: int, ours_clocked: list[Clocked],
                base_clocked: list[Clocked], goal: float, **extra: object) -> None:
    """One row from interleaved rounds: medians of both, the median of the per-round
    ratios (``ratio``, what the goal is judged on), every round's ratio, the median
    per-round ratio of process CPU seconds (``cpu_ratio``) and the load average."""
    ours = [w for w, _ in ours_clocked]
    base = [w for w, _ in base_clocked]
    ratios = sorted(b / a for a, b in zip(ours, base, strict=True))
    cpu = [b[1] / a[1] for a, b in zip(ours_clocked, base_clocked, strict=True)
           if a[1] > 0 and b[1] > 0]
    row: dict[str, object] = {
        "bench": "transfer", "row": name, "bytes": nbytes,
        "gb_per_s": round(nbytes / statistics.median(ours) / 1e9, 3),
        "baseline_gb_per_s": round(nbytes / statistics.median(base) / 1e9, 3),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_best_of": round(min(base) / min(ours), 3),
        "round_ratios": [round(r, 3) for r in ratios],
        "cpu_ratio": round(statistics.median(cpu), 3) if cpu else None,
        "goal_ratio": goal, "goal_met": statistics.median(ratios) >= goal,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    row.update(extra)
    print(json.dumps(row), flush=True)


def layout_for(args: argparse.Namespace) -> KVLayout:
    """The benchmarked stage shape."""
    return KVLayout(num_layers=args.layers, num_kv_heads=args.heads, head_size=args.head_size,
                    kv_dim=2, dtype=KVDtype.BFLOAT16, tokens_per_block=args.tokens_per_block)


def engine_buffers(layout: KVLayout, num_slots: int,
                   device: str = "cpu") -> list[list[torch.Tensor]]:
    """SGLang-style k_buffer / v_buffer lists filled with random bf16."""
    shape = (num_slots, layout.heads_per_rank, layout.head_size)
    return [[torch.randn(shape, device=device).to(torch.bfloat16)
             for _ in range(layout.num_layers)] for _ in range(2)]


def slot_mapping(style: str, lo: int, n: int, tpb: int, seed: int) -> np.ndarray:
    """``n`` engine slots from ``lo``: shuffled aligned pages of ``tpb`` slots in
    ``[lo, lo + n)`` (SGLang with ``page_size == tokens_per_block``), shuffled single
    slots in ``[lo, lo + n)`` (``tokens``) or shuffled single slots drawn from
    ``[lo, lo + 2n)`` (``sparse``: a fragmented pool)."""
    rng = np.random.default_rng(seed)
    if style == "pages":
        pages = rng.permutation(n // tpb) + lo // tpb
        return (pages[:, None] * tpb + np.arange(tpb)).reshape(-1).astype(np.int64)
    if style == "sparse":
        return (rng.permutation(2 * n)[:n] + lo).astype(np.int64)
    return (rng.permutation(n) + lo).astype(np.int64)


def bench_cpu(args: argparse.Namespace, layout: KVLayout, style: str) -> None:
    """CPU tier store and load versus a flat torch copy, with ``style`` slot mappings
    (engine buffers on ``args.engine_device``)."""
    gpu = args.engine_device == "cuda"
    n = args.tokens
    nbytes = n * layout.bytes_per_token
    cfg = EmbeddedBackendConfig(layout=layout, cpu_bytes=nbytes * 2, pinned=True,
                                worker_threads=args.workers, copy_lanes=args.lanes)
    backend = EmbeddedBackend(cfg)
    backend.start()
    spread = 2 if style == "sparse" else 1  # slots span `spread * n` engine slots
    bufs = engine_buffers(layout, 2 * spread * n, args.engine_device)
    backend.register_kv_buffers(0, bufs)
    tpb = layout.tokens_per_block
    src_slots = slot_mapping(style, 0, n, tpb, 1)
    dst_slots = slot_mapping(style, spread * n, n, tpb, 2)
    copy_once, copy_back = _flat_copies(nbytes, args.engine_device)
    rng = np.random.default_rng(0)

    def store_once() -> Clocked:
        backend.reset()
        toks = rng.integers(0, 100_000, n, dtype=np.int64)
        tid, mask = backend.put_match(toks)

        def run() -> None:
            [w] = backend.launch([tid], [src_slots[mask]])
            assert backend.wait([w], timeout=120)[w].status.value == "success"
        return _clocked(run)

    goal = 0.9 if style == "pages" else 0.8
    kind = "gpu" if gpu else "cpu"
    store, base = _paired(store_once, copy_once, args.cpu_rounds)
    _paired_row(f"{kind}_store", nbytes, store, base, goal, tokens=n, slots=style,
                lanes=args.lanes, **_path(gpu))
    toks = rng.integers(0, 100_000, n, dtype=np.int64)
    backend.reset()
    tid, mask = backend.put_match(toks)
    [w] = backend.launch([tid], [src_slots[mask]])
    backend.wait([w], timeout=120)

    def load_once() -> Clocked:
        tid, mask = backend.get_match(toks)

        def run() -> None:
            [w] = backend.launch([tid], [dst_slots[mask]])
            assert backend.wait([w], timeout=120)[w].status.value == "success"
        return _clocked(run)

    load, base = _paired(load_once, copy_back if gpu else copy_once, args.cpu_rounds)
    src_idx = torch.as_tensor(src_slots, device=args.engine_device)
    dst_idx = torch.as_tensor(dst_slots, device=args.engine_device)
    if not all(torch.equal(t[dst_idx], t[src_idx]) for group in bufs for t in group):
        raise SystemExit(f"{kind}_load ({style}): the loaded slots differ from the stored ones")
    _paired_row(f"{kind}_load", nbytes, load, base, goal, tokens=n, slots=style,
                lanes=args.lanes, **_path(gpu))
    backend.shutdown()


def bench_strided(args: argparse.Namespace, layout: KVLayout, stride: int) -> None:
    """Store into and load from every ``stride``-th CPU tier block through the
    block copier, against the flat copies of :func:`bench_cpu`."""
    gpu = args.engine_device == "cuda"
    n = args.tokens
    tpb = layout.tokens_per_block
    nbytes = n * layout.bytes_per_token
    tier = CpuTier(layout, stride * (n // tpb), pinned=gpu)
    copier = BlockCopier(layout, tier, None, args.lanes)
    regs = {0: register_buffers(layout, 0, engine_buffers(layout, 2 * n, args.engine_device))}
    blocks = list(range(0, stride * (n // tpb), stride))
    src_slots = torch.as_tensor(slot_mapping("pages", 0, n, tpb, 1))
    dst_slots = torch.as_tensor(slot_mapping("pages", n, n, tpb, 2))
    copy_once, copy_back = _flat_copies(nbytes, args.engine_device)
    kind = "gpu" if gpu else "cpu"
    store, base = _paired(lambda: _clocked(lambda: copier.store(regs, blocks, src_slots)),
                          copy_once, args.cpu_rounds)
    _paired_row(f"{kind}_store_strided", nbytes, store, base, 0.8, tokens=n, stride=stride,
                **_path(gpu))
    where = block_locations(Tier.CPU, blocks)
    load, base = _paired(lambda: _clocked(lambda: copier.load(regs, where, dst_slots)),
                         copy_back, args.cpu_rounds)
    _paired_row(f"{kind}_load_strided", nbytes, load, base, 0.8, tokens=n, stride=stride,
                **_path(gpu))
    for plane in regs[0].planes:
        if not torch.equal(plane[dst_slots.to(plane.device)], plane[src_slots.to(plane.device)]):
            raise SystemExit(f"{kind}_load_strided: the loaded slots differ from the stored ones")


def _path(gpu: bool) -> dict[str, str]:
    """``{"path": ...}``: how host <-> device rows move in this run (CUDA rows only)."""
    if not gpu:
        return {}
    if not transfer.DEVICE_STAGING:
        return {"path": "direct"}
    return {"path": "mapped" if mapped_rows.ENABLED else "staged"}


def _flat_copies(nbytes: int, device: str) -> tuple[Callable[[], Clocked],
                                                     Callable[[], Clocked]]:
    """The baselines: one ``copy_`` of ``nbytes`` out of a tensor on ``device`` into
    host memory (pinned for cuda) and one back, each finished on the device too."""
    gpu = device == "cuda"
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu).fill_(2)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        if gpu:
            torch.cuda.synchronize()

    return (lambda: _clocked(lambda: copy(b, a))), (lambda: _clocked(lambda: copy(a, b)))


def bench_ssd(args: argparse.Namespace, layout: KVLayout, directory: Path) -> None:
    """Spill to and load from the SSD tier versus plain file write/read of the same bytes."""
    n = args.ssd_tokens
    nbytes = n * layout.bytes_per_token
    cfg = EmbeddedBackendConfig(layout=layout, cpu_bytes=nbytes, pinned=True,
                                ssd_bytes=nbytes * 2, ssd_paths=(str(directory / "tier"),),
                                high_watermark=1.0, low_watermark=1.0,
                                worker_threads=args.workers)
    backend = EmbeddedBackend(cfg)
    backend.start()
    bufs = engine_buffers(layout, 2 * n)
    backend.register_kv_buffers(0, bufs)
    rng = np.random.default_rng(1)
    first = rng.integers(0, 100_000, n, dtype=np.int64)
    second = rng.integers(0, 100_000, n, dtype=np.int64)
    tpb = layout.tokens_per_block
    slots = slot_mapping("pages", 0, n, tpb, 3)
    for toks in (first,):
        tid, mask = backend.put_match(toks)
        [w] = backend.launch([tid], [slots[mask]])
        backend.wait([w], timeout=120)
    t0 = time.perf_counter()
    tid, mask = backend.put_match(second)  # the CPU tier is full: every block of `first` spills
    spill = time.perf_counter() - t0
    backend.cancel([tid])
    stats = backend.stats().tiers
    spilled = stats["ssd"].used_blocks * layout.bytes_per_block
    plain = directory / "plain.bin"
    data = torch.empty(spilled, dtype=torch.uint8).fill_(3).numpy()
    fd = os.open(plain, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, spilled)  # preallocated, as the tier's files are
        write = _timed(lambda: os.pwrite(fd, data.data, 0))
        _row("ssd_spill", spilled, spill, write, None, tokens=n, slots="pages")
        out = np.empty_like(data)
        read = _best(lambda: _timed(lambda: os.preadv(fd, [out.data], 0)), args.repeat)
    finally:
        os.close(fd)
        plain.unlink()
    dst = slot_mapping("pages", n, n, tpb, 4)

    def load_once() -> float:
        tid, mask = backend.get_match(first)
        t0 = time.perf_counter()
        [w] = backend.launch([tid], [dst[mask]])
        assert backend.wait([w], timeout=120)[w].status.value == "success"
        return time.perf_counter() - t0

    load = _best(load_once, args.repeat)
    _row("ssd_load", spilled, load, read, None, tokens=n, slots="pages")
    backend.shutdown()


def main(argv: list[str] | None = None) -> None:
    """Parse flags and print one JSON object per row."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per CPU transfer")
    p.add_argument("--ssd-tokens", type=int, default=2048, help="tokens spilled and loaded")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5,
                   help="rounds per row (SSD rows: best of; CPU rows: interleaved rounds)")
    p.add_argument("--cpu-rounds", type=int, default=15,
                   help="interleaved rounds of ours vs the torch copy per CPU row")
    p.add_argument("--lanes", type=int, default=2,
                   help="copy lanes for CPU rows (a pool's tiers.cpu.copyLanes; agents use 2)")
    p.add_argument("--ssd-dir", default=None,
                   help="directory for the SSD tier (default: a temp dir)")
    p.add_argument("--skip-ssd", action="store_true")
    p.add_argument("--tier-stride", type=int, default=0,
                   help="also the *_strided rows: copies into and out of every K-th tier block")
    p.add_argument("--direct", action="store_true",
                   help="plain torch ops for host <-> device rows (the kernel's and staged "
                        "moves' before)")
    p.add_argument("--no-mapped", action="store_true",
                   help="the staged host <-> device moves without the GPU row kernel")
    p.add_argument("--engine-device", choices=("cpu", "cuda"), default="cpu",
                   help="where the engine's KV buffers live for the CPU-tier rows (cuda: "
                        "gpu_store / gpu_load rows, pinned tier)")
    p.add_argument("--slots", default="pages,tokens,sparse",
                   help="slot mapping styles for the CPU rows: pages (shuffled aligned pages, "
                        "as SGLang with page_size == tokens_per_block), tokens (shuffled slots), "
                        "sparse (shuffled slots spread over twice as many)")
    args = p.parse_args(argv)
    if args.engine_device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--engine-device cuda needs a CUDA build of torch and a GPU")
    layout = layout_for(args)
    transfer.DEVICE_STAGING = not args.direct
    mapped_rows.ENABLED = mapped_rows.ENABLED and not args.no_mapped
    for style in filter(None, args.slots.split(",")):
        bench_cpu(args, layout, style)
    if args.tier_stride:
        bench_strided(args, layout, args.tier_stride)
    if not args.skip_ssd:
        with tempfile.TemporaryDirectory(dir=args.ssd_dir, prefix="flexkv-bench-") as d:
            bench_ssd(args, layout, Path(d))


if __name__ == "__main__":
    main()

"""The GPU row kernel (node_agent.backend.mapped_rows) against the copy engine.

On a GPU host, with a Llama-3-8B stage's planes (64 planes of ``--tokens`` rows)
held as one pinned host tensor and one device tensor of the same size, each row
moves to a shuffled row on the other side (``load``: host to device, ``store``:
device to host), timed to a device synchronise, median of ``--repeat``:

* ``per_plane``: one kernel launch per plane, as the block copier issues them;
* ``one_launch``: one launch over every row of every plane (what a kernel over
  all planes of a task would reach);

each for token rows (2 KiB, SGLang's page size 1) and page rows (16 tokens,
32 KiB), and for each ``--blocks`` x ``--warps`` setting. The baseline, in the
same process: one ``copy_`` of the same bytes between the pinned host tensor and
the device (the copy engine's best case), alternated with the kernel runs.
``ratio`` = kernel GB/s / baseline GB/s. One JSON object per row.

Run: ``python -P bench/mapped_rows.py`` (needs a CUDA build of torch, Triton and
a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from node_agent.backend import mapped_rows


def _timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _rows_case(args: argparse.Namespace, host: torch.Tensor, dev: torch.Tensor,
               unit: str, tokens_per_row: int,
               flat: dict[str, Callable[[], object]]) -> None:
    """Every setting's rows for one row width (``unit``)."""
    nbytes = host.numel()
    width = args.token_bytes * tokens_per_row
    rows = args.tokens // tokens_per_row
    g = torch.Generator().manual_seed(rows)
    perm = torch.randperm(rows, generator=g).cuda()
    all_perm = torch.cat([perm + k * rows for k in range(args.planes)])
    h2 = host.view(args.planes * rows, width)
    d2 = dev.view(args.planes * rows, width)
    planes = [(h2[k * rows:(k + 1) * rows], d2[k * rows:(k + 1) * rows])
              for k in range(args.planes)]

    def per_plane(way: str) -> None:
        for hp, dp in planes:
            dst, src = (dp, hp) if way == "load" else (hp, dp)
            assert mapped_rows.move_rows(dst, perm, 0, src, None, 0, rows)

    def one_launch(way: str) -> None:
        dst, src = (d2, h2) if way == "load" else (h2, d2)
        assert mapped_rows.move_rows(dst, all_perm, 0, src, None, 0, args.planes * rows)

    blocks = [int(b) for b in args.blocks.split(",")]
    for block in blocks:
        if block > width and block != blocks[0]:
            continue  # the same kernel as the first setting for rows this narrow
        for warps in (int(w) for w in args.warps.split(",")):
            mapped_rows.BLOCK_BYTES, mapped_rows.WARPS = block, warps
            for way in ("load", "store"):
                for name, run in (("per_plane", per_plane), ("one_launch", one_launch)):
                    def fn(run: Callable[[str], None] = run, way: str = way) -> None:
                        run(way)
                    _timed(fn)  # compile and warm up
                    ks, bs = [], []
                    for _ in range(args.repeat):
                        ks.append(_timed(fn))
                        bs.append(_timed(flat[way]))
                    k, b = statistics.median(ks), statistics.median(bs)
                    print(json.dumps({
                        "bench": "mapped_rows", "row": f"{way}_{unit}_{name}",
                        "block_bytes": min(block, width), "warps": warps,
                        "row_bytes": width, "bytes": nbytes,
                        "gb_per_s": round(nbytes / k / 1e9, 2),
                        "baseline_gb_per_s": round(nbytes / b / 1e9, 2),
                        "ratio": round(b / k, 3)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="token rows per plane")
    p.add_argument("--planes", type=int, default=64)
    p.add_argument("--token-bytes", type=int, default=2048, help="one token of one plane")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--blocks", default="2048,8192,16384", help="BLOCK_BYTES settings")
    p.add_argument("--warps", default="4,8", help="WARPS settings")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/mapped_rows.py needs a CUDA build of torch and a GPU")
    nbytes = args.planes * args.tokens * args.token_bytes
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat: dict[str, Callable[[], object]] = {
        "load": lambda: dev.copy_(host, non_blocking=True),
        "store": lambda: host.copy_(dev, non_blocking=True)}
    _rows_case(args, host, dev, "token", 1, flat)
    _rows_case(args, host, dev, "page", 16, flat)


if __name__ == "__main__":
    main()

"""A persistent SSD tier across a restart: time to ready and to the first hit, scan rate,
the hits that survive, and what persistence costs a spill.

A Llama-3-8B-shaped stage (32 layers, 8 KV heads of 128, bf16, 16 tokens per block:
2 MiB per block) on CPU tensors, the embedded backend in this process. The workload
stores ``--prompt-blocks``-block prompts, as many blocks as the SSD tier (``--gb``
GB) holds, with a CPU tier a quarter that size (so at the stop the CPU tier holds
the newest quarter and the SSD tier the rest), then the backend is stopped and
started again on the same files. Rows (one JSON object each):

* ``fill``: the stores with persistence on versus off (fresh files each), the
  spills to SSD included; ``ratio`` = persistent GB/s / plain GB/s (the cost of the
  per-block checksum and record).
* ``restart`` (clean stop): ``stop_seconds`` (the CPU tier spilled to SSD),
  ``ready_seconds`` (``start()`` + registering the engine: what an engine's first
  registration waits for; goal <= 5 s), ``first_hit_seconds`` (from the start until a
  stored prompt is a hit again: the background verification), ``scan_gb_per_s``
  (recorded bytes read back and checksummed per second; goal >= 1 GB/s).
* ``hit_rate`` (``clean`` stop, and ``no_spill``: a stop that spills nothing, so
  the CPU tier is lost as after a SIGKILL): the share of the workload's tokens that
  hit when it is replayed after the restart versus before it (``ratio``).

The SSD tier lives in ``--dir`` (default: a temporary directory), page cache
included: the scan rate is then bound by checksumming, not by a device. Run:
``python bench/restart.py [--gb 1.0]`` (the issue's 10 GB scaled down so a run
takes about a minute on two shared cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.vocab.layout import KVLayout

READY_GOAL_S = 5.0
SCAN_GOAL_GBPS = 1.0


def _row(name: str, **fields: object) -> None:
    print(json.dumps({"bench": "restart", "row": name, **fields}), flush=True)


def _config(args: argparse.Namespace, directory: Path, persist: bool,
            ) -> EmbeddedBackendConfig:
    layout = KVLayout(num_layers=args.layers, num_kv_heads=8, head_size=128)
    bpb = layout.bytes_per_block
    ssd_blocks = max(2 * args.prompt_blocks, int(args.gb * 1e9) // bpb)
    cpu_blocks = max(2 * args.prompt_blocks, ssd_blocks // 4)
    return EmbeddedBackendConfig(
        layout=layout, cpu_bytes=cpu_blocks * bpb, ssd_bytes=ssd_blocks * bpb,
        ssd_paths=(str(directory),), pinned=False, ssd_persist=persist, pool="bench",
        high_watermark=1.0, low_watermark=1.0, deferred_visibility=False,
    )


def _buffers(cfg: EmbeddedBackendConfig, slots: int) -> list[list[torch.Tensor]]:
    lay = cfg.layout
    g = torch.Generator().manual_seed(0)
    return [[torch.randn((slots, lay.heads_per_rank, lay.head_size), generator=g)
             .to(lay.dtype.torch_dtype) for _ in range(lay.num_layers)] for _ in range(2)]


def _prompts(cfg: EmbeddedBackendConfig, blocks: int) -> list[np.ndarray]:
    """As many prompts as the SSD tier holds: the CPU tier holds the newest quarter
    of them at the stop, the SSD tier the rest."""
    n = cfg.ssd_blocks // blocks
    rng = np.random.default_rng(7)
    return [rng.integers(0, 50_000, blocks * cfg.tokens_per_block, dtype=np.int64)
            for _ in range(n)]


def _fill(b: EmbeddedBackend, prompts: list[np.ndarray]) -> float:
    """Store every prompt (slots 0..len); returns the seconds it took."""
    slots = np.arange(len(prompts[0]), dtype=np.int64)
    t0 = time.perf_counter()
    for p in prompts:
        tid, mask = b.put_match(p)
        if tid < 0:
            continue
        [wid] = b.launch([tid], [slots[mask]])
        res = b.wait([wid], timeout=60)[wid]
        assert res.status.value == "success", res
    return time.perf_counter() - t0


def _hit_share(b: EmbeddedBackend, prompts: list[np.ndarray]) -> float:
    """The share of the prompts' tokens a lookup hits (matches are cancelled)."""
    hit = 0
    for p in prompts:
        tid, mask = b.get_match(p)
        if tid >= 0:
            hit += int(mask.sum())
            b.cancel([tid])
    return hit / sum(len(p) for p in prompts)


def _started(cfg: EmbeddedBackendConfig, bufs: list[list[torch.Tensor]]) -> EmbeddedBackend:
    b = EmbeddedBackend(cfg)
    b.start()
    b.register_kv_buffers(0, bufs)
    return b


def _scenario(args: argparse.Namespace, root: Path, spill: bool) -> None:
    name = "clean" if spill else "no_spill"
    cfg = _config(args, root / name, persist=True)
    if not spill:
        cfg = dataclasses.replace(cfg, stop_spill_seconds=0.0)
    bufs = _buffers(cfg, args.prompt_blocks * cfg.tokens_per_block)
    prompts = _prompts(cfg, args.prompt_blocks)
    b = _started(cfg, bufs)
    _fill(b, prompts)
    before = _hit_share(b, prompts)
    t0 = time.perf_counter()
    b.shutdown()
    stop_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = _started(cfg, bufs)
    ready_s = time.perf_counter() - t0
    first: float | None = None
    while first is None and not again.recovery_done.is_set():
        tid, _ = again.get_match(prompts[-1])  # the newest (spilled by the clean stop)
        if tid >= 0:
            again.cancel([tid])
            first = time.perf_counter() - t0
        else:
            time.sleep(0.001)
    assert again.recovery_done.wait(600), "recovery did not end"
    if first is None:
        tid, _ = again.get_match(prompts[-1])
        if tid >= 0:
            again.cancel([tid])
            first = time.perf_counter() - t0
    after = _hit_share(again, prompts)
    again.shutdown()
    rec = again.recovery
    scanned = rec.bytes_verified if rec else 0
    scan_s = rec.seconds if rec else 0.0
    if spill:
        gbps = scanned / scan_s / 1e9 if scan_s else None
        _row("restart", stop=name, stop_seconds=round(stop_s, 3),
             spilled_on_stop=b.spilled_on_stop, ready_seconds=round(ready_s, 3),
             ready_goal_seconds=READY_GOAL_S, ready_goal_met=ready_s <= READY_GOAL_S,
             first_hit_seconds=None if first is None else round(first, 3),
             recovered_blocks=again.recovered_blocks, scanned_bytes=scanned,
             scan_seconds=round(scan_s, 3),
             scan_gb_per_s=None if gbps is None else round(gbps, 3),
             scan_goal_gb_per_s=SCAN_GOAL_GBPS,
             scan_goal_met=gbps is not None and gbps >= SCAN_GOAL_GBPS)
    _row("hit_rate", stop=name, before=round(before, 4), after=round(after, 4),
         ratio=round(after / before, 4) if before else None, prompts=len(prompts),
         spilled_on_stop=b.spilled_on_stop, recovered_blocks=again.recovered_blocks,
         dropped=again.recovered_dropped, ssd_blocks=cfg.ssd_blocks,
         cpu_blocks=cfg.cpu_blocks)


def _fill_row(args: argparse.Namespace, root: Path) -> None:
    seconds = {}
    nbytes = 0
    for persist in (False, True, False, True):  # alternated: both see the same load
        d = root / f"fill-{persist}"
        cfg = _config(args, d, persist)
        bufs = _buffers(cfg, args.prompt_blocks * cfg.tokens_per_block)
        prompts = _prompts(cfg, args.prompt_blocks)
        b = _started(cfg, bufs)
        t = _fill(b, prompts)
        b.shutdown()
        shutil.rmtree(d, ignore_errors=True)
        seconds[persist] = min(seconds.get(persist, t), t)
        nbytes = len(prompts) * args.prompt_blocks * cfg.layout.bytes_per_block
    plain, persistent = nbytes / seconds[False] / 1e9, nbytes / seconds[True] / 1e9
    _row("fill", bytes=nbytes, gb_per_s=round(persistent, 3),
         baseline_gb_per_s=round(plain, 3), ratio=round(persistent / plain, 3),
         baseline="the same stores with persistence off")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="SSD tier size in GB")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prompt-blocks", type=int, default=16, help="blocks per prompt")
    p.add_argument("--dir", default=None, help="where the SSD tier's files go")
    args = p.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="flexkv-restart-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        _fill_row(args, root)
        _scenario(args, root, spill=True)
        _scenario(args, root, spill=False)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    _row("load", loadavg=[round(x, 2) for x in os.getloadavg()])


if __name__ == "__main__":
    main()

"""Match latency of the embedded backend for long prompts against a large index.

Fills the index with ``--blocks`` blocks (prompts of ``--prompt-tokens`` tokens,
stored through put_match/launch/wait on a tiny KV layout so the tier fits in
memory; the index cost does not depend on the KV size), then times, over
``--iters`` random cached prompts:

* ``get_match_hit``: a full-prompt hit (then cancel, outside the timing);
* ``put_match_cached``: a put of a fully cached prompt (nothing to store);
* ``put_match_new``: a put of a new prompt (allocates every block; cancelled after).

Each row reports wall-clock p50/p99 in ms, the 2 ms p99 goal, and the ratio of
p99 to the baseline measured in the same run: hashing the prompt alone (xxh3_64
chained), the floor any lookup pays. ``cpu_p50_ms`` / ``cpu_p99_ms`` are the
calling thread's CPU time, which leaves out time the thread waited for a core on
a shared machine; ``preempted_calls`` counts calls during which the thread was
switched out involuntarily (``getrusage`` of the thread) and
``p99_ms_not_preempted`` is the wall p99 of the other calls, to tell index cost
from waiting for a core (``p99_ms`` stays the figure the goal is judged on). A
``memory`` row reports index bytes per block from ``tracemalloc`` (Python
allocations of the index, sampled over a smaller fill) and the RSS growth of the
big fill divided by blocks (tier bytes and the benchmark's own prompt arrays
subtracted).

Run: ``python bench/match.py`` (1M blocks, about 10-20 s on 2 cores) or
``python bench/match.py --blocks 20000 --iters 50`` for a quick look.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.hashing import BlockHasher
from node_agent.vocab.layout import KVDtype, KVLayout


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _layout(tpb: int) -> KVLayout:
    # One layer, one latent of width 1, fp16: 2 bytes per token.
    return KVLayout(num_layers=1, num_kv_heads=1, head_size=1, kv_dim=1,
                    dtype=KVDtype.FLOAT16, tokens_per_block=tpb)


def fill(blocks: int, prompt_tokens: int, tpb: int, seed: int = 0,
         ) -> tuple[EmbeddedBackend, list[np.ndarray]]:
    """A started backend whose index holds ``blocks`` blocks; returns it and its prompts."""
    layout = _layout(tpb)
    per_prompt = prompt_tokens // tpb
    headroom = 2 * per_prompt
    cfg = EmbeddedBackendConfig(
        layout=layout, cpu_bytes=(blocks + headroom) * layout.bytes_per_block, pinned=False,
        high_watermark=1.0, low_watermark=1.0, unlaunched_match_seconds=600.0,
    )
    b = EmbeddedBackend(cfg)
    b.start()
    b.register_kv_buffers(0, [[torch.zeros(prompt_tokens, 1, 1, dtype=torch.float16)]])
    rng = np.random.default_rng(seed)
    slots = np.arange(prompt_tokens, dtype=np.int64)
    prompts = []
    stored = 0
    while stored < blocks:
        n = min(per_prompt, blocks - stored) * tpb
        toks = rng.integers(0, 128_000, n, dtype=np.int64)
        tid, mask = b.put_match(toks)
        [w] = b.launch([tid], [slots[: int(mask.sum())]])
        b.wait([w], timeout=60)
        prompts.append(toks)
        stored += n // tpb
    return b, prompts


def _percentiles(samples: list[float]) -> tuple[float, float]:
    a = np.asarray(samples) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _switches() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def _time(fn: Callable[[], object], after: Callable[[object], None] | None,
          ) -> tuple[float, float, bool]:
    """Wall seconds, this thread's CPU seconds of one call of ``fn``, and whether the
    thread was preempted around it."""
    s0 = _switches()
    c0, t0 = time.thread_time(), time.perf_counter()
    out = fn()
    dt, dc = time.perf_counter() - t0, time.thread_time() - c0
    preempted = _switches() != s0
    if after is not None:
        after(out)
    return dt, dc, preempted


def main(argv: list[str] | None = None) -> None:
    """Parse flags and print one JSON object per row."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks in the index")
    p.add_argument("--prompt-tokens", type=int, default=32_768)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--memory-sample-blocks", type=int, default=50_000,
                   help="blocks in the tracemalloc sample (small: tracemalloc is slow)")
    args = p.parse_args(argv)
    tpb, n = args.tokens_per_block, args.prompt_tokens

    # Memory per indexed block, Python allocations only, on a smaller fill.
    gc.collect()
    tracemalloc.start()
    small = fill(min(args.memory_sample_blocks, args.blocks), n, tpb, seed=1)[0]  # prompts freed
    gc.collect()
    mem_blocks = small.stats().tiers["cpu"].used_blocks
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    small.shutdown()
    del small
    gc.collect()

    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    b, prompts = fill(args.blocks, n, tpb)
    fill_s = time.perf_counter() - t0
    rss = _rss_bytes() - rss0
    tier_bytes = b.stats().tiers["cpu"].capacity_bytes
    prompt_bytes = sum(q.nbytes for q in prompts)  # the benchmark's own copy of the prompts
    full = [q for q in prompts if len(q) == n] or prompts
    rng = np.random.default_rng(2)
    hasher = BlockHasher(tpb)

    def pick() -> np.ndarray:
        return full[int(rng.integers(len(full)))]

    base = [_time(lambda: hasher.hashes(pick()), None) for _ in range(args.iters)]
    cancel: Callable[[object], None] = lambda out: b.cancel([out[0]])  # type: ignore[index]  # noqa: E731
    get = [_time(lambda: b.get_match(pick()), cancel) for _ in range(args.iters)]
    put_cached = [_time(lambda: b.put_match(pick()), cancel) for _ in range(args.iters)]
    fresh = np.random.default_rng(3)
    new_prompts = [fresh.integers(0, 128_000, n, dtype=np.int64) for _ in range(args.iters)]
    it = iter(new_prompts)
    put_new = [_time(lambda: b.put_match(next(it)), cancel) for _ in range(args.iters)]
    b50, b99 = _percentiles([w for w, _, _ in base])
    for name, samples in (("get_match_hit", get), ("put_match_cached", put_cached),
                          ("put_match_new", put_new)):
        p50, p99 = _percentiles([w for w, _, _ in samples])
        c50, c99 = _percentiles([c for _, c, _ in samples])
        calm = [w for w, _, pre in samples if not pre] or [float("nan")]
        print(json.dumps({
            "bench": "match", "row": name, "prompt_tokens": n, "index_blocks": args.blocks,
            "p50_ms": round(p50, 3), "p99_ms": round(p99, 3),
            "baseline": "hash_prompt_only", "baseline_p50_ms": round(b50, 3),
            "baseline_p99_ms": round(b99, 3), "ratio_p99": round(p99 / b99, 2),
            "goal_p99_ms": 2.0, "goal_met": p99 <= 2.0,
            "cpu_p50_ms": round(c50, 3), "cpu_p99_ms": round(c99, 3),
            "preempted_calls": sum(1 for _, _, pre in samples if pre),
            "p99_ms_not_preempted": round(_percentiles(calm)[1], 3),
            "baseline_preempted_calls": sum(1 for _, _, pre in base if pre),
        }), flush=True)
    print(json.dumps({
        "bench": "match", "row": "memory", "index_blocks": args.blocks,
        "tracemalloc_bytes_per_block": round(traced / max(1, mem_blocks), 1),
        "tracemalloc_sample_blocks": mem_blocks,
        "rss_bytes_per_block": round((rss - tier_bytes - prompt_bytes) / max(1, args.blocks), 1),
        "fill_seconds": round(fill_s, 2),
    }), flush=True)
    b.shutdown()


if __name__ == "__main__":
    main()
    # Every row is printed and every backend shut down. Skip the interpreter's
    # teardown: destroying torch's native thread pools while the million-block
    # index is freed has aborted the process at exit ("terminate called without an
    # active exception", exit 134), which stopped `make bench` after this script.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

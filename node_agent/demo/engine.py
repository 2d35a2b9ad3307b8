"""A synthetic engine rank (its own process): shared-memory KV buffers, the client
library, and the demo workload.

Per request it does what an engine with a KV connector does: ``lookup`` the
prompt, ``retrieve`` the hit into fresh slots (and checks every loaded value
bit-exactly), "prefill" the rest by writing :func:`.workload.kv_values` into the
slots, ``store_kv`` prompt + reply, wait until ``poll_completed`` reports the
request (its slots are then free) and ``release`` it. When that wait times out
the request's slots are quarantined (the agent may still read them) until a
later ``poll_completed`` reports it; when no free run of slots is left the run
fails naming the quarantined requests.

Protocol with the runner, one JSON object per line on stdout:
``{"registered": rank}`` once the buffers are registered (then it waits for a
``go`` line on stdin), ``{"progress": i, "total": n}`` after each request, and
``{"result": {...}}`` with counts and per-call latencies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.demo.workload import DemoRequest, WorkloadSpec, generate, kv_values
from node_agent.vocab.layout import KVLayout


class DemoEngine:
    """One engine rank driving the workload through an :class:`EngineClient`."""

    def __init__(self, client: EngineClient, layout: KVLayout, num_slots: int,
                 store_wait: float = 10.0) -> None:
        self.client = client
        self.layout = layout
        self.bufs = SharedKVBuffers.for_layout(layout, num_slots)
        self.planes = [t for group in self.bufs.tensors for t in group]
        self.num_slots = num_slots
        self.store_wait = store_wait
        self.latencies: dict[str, list[float]] = {
            "lookup": [], "retrieve": [], "store_kv": [], "store_done": []}
        self.counts = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0, "loaded_tokens": 0,
                       "stored_tokens": 0, "mismatched_tokens": 0, "store_timeouts": 0}
        self._next = 0
        self._completed: set[str] = set()
        self._quarantine: dict[str, np.ndarray] = {}
        self._blocked = np.zeros(num_slots, dtype=np.bool_)

    def register(self) -> dict[str, Any]:
        """Register the shared buffers with the agent."""
        return self.client.register_kv_buffers(self.layout, self.bufs.handles)

    def _slots(self, n: int) -> np.ndarray:
        """``n`` consecutive slots, round robin, never a quarantined one."""
        if n > self.num_slots:
            raise ValueError(f"request of {n} tokens exceeds the engine's {self.num_slots} "
                             "slots; raise --num-slots")
        for attempt in range(2):
            if attempt and self._quarantine:
                self._poll()  # a late completion may have freed quarantined slots
            for start in (self._next, 0):
                first = self._free_run(start, n)
                if first is not None:
                    self._next = first + n
                    return np.arange(first, first + n, dtype=np.int64)
        raise RuntimeError(
            f"no {n} consecutive slots are free: {int(self._blocked.sum())} of "
            f"{self.num_slots} are quarantined by stores that did not complete within "
            f"{self.store_wait}s ({', '.join(sorted(self._quarantine))}); the agent may still "
            "read them. Raise --timeout or --num-slots, or check the agents' /status"
        )

    def _free_run(self, start: int, n: int) -> int | None:
        p = start
        while p + n <= self.num_slots:
            busy = np.flatnonzero(self._blocked[p:p + n])
            if not len(busy):
                return p
            p += int(busy[-1]) + 1
        return None

    def _quarantine_slots(self, rid: str, slots: np.ndarray) -> None:
        """A store of ``rid`` did not complete in time: its source slots may still be
        read, so they are not reused until ``poll_completed`` reports ``rid``."""
        self._quarantine[rid] = slots
        self._blocked[slots] = True

    def _poll(self) -> None:
        self._completed.update(self.client.poll_completed())
        for rid in [r for r in self._quarantine if r in self._completed]:
            self._blocked[self._quarantine.pop(rid)] = False
            self._completed.discard(rid)

    def _bits(self, plane: torch.Tensor) -> torch.Tensor:
        """The plane as integers of the same width: copies and compares are bit-exact
        (and far faster on a CPU than float16 arithmetic)."""
        ints = {2: torch.int16, 4: torch.int32}[plane.element_size()]
        return plane.view(plane.shape[0], -1).view(ints)

    def _write(self, tokens: np.ndarray, start: int, slots: np.ndarray) -> None:
        idx = torch.from_numpy(slots)
        for p, plane in enumerate(self.planes):
            bits = self._bits(plane)
            vals = kv_values(tokens, start, p, plane.dtype).view(bits.dtype)
            bits[idx] = vals.view(-1, 1).expand(-1, bits.shape[1])

    def _mismatches(self, tokens: np.ndarray, slots: np.ndarray) -> int:
        idx = torch.from_numpy(slots)
        bad = torch.zeros(len(slots), dtype=torch.bool)
        for p, plane in enumerate(self.planes):
            bits = self._bits(plane)
            got = bits[idx]
            want = kv_values(tokens, 0, p, plane.dtype).view(bits.dtype).view(-1, 1)
            if not torch.equal(got, want.expand_as(got)):  # the fast path when all match
                bad |= got.ne(want).any(dim=1)
        return int(bad.sum())

    def _timed(self, op: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        self.latencies[op].append(time.perf_counter() - t0)
        return out

    def serve(self, req: DemoRequest) -> None:
        """Run one request end to end."""
        full = req.full
        slots = self._slots(len(full))
        hit = int(self._timed("lookup", self.client.lookup, req.rid, req.prompt))
        loaded = 0
        if hit > 0:
            loaded = int(self._timed("retrieve", self.client.retrieve, req.rid, slots[:hit]))
            self.counts["mismatched_tokens"] += self._mismatches(full[:loaded], slots[:loaded])
        self._write(full[loaded:], loaded, slots[loaded:])
        t0 = time.perf_counter()
        task = int(self._timed("store_kv", self.client.store_kv, req.rid, full, slots))
        if task >= 0 and not self._wait_stored(req.rid):
            self.counts["store_timeouts"] += 1
            self._quarantine_slots(req.rid, slots)
        self.latencies["store_done"].append(time.perf_counter() - t0)
        self.client.release(req.rid)
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += len(req.prompt)
        self.counts["hit_tokens"] += hit
        self.counts["loaded_tokens"] += loaded
        self.counts["stored_tokens"] += len(full)

    def _wait_stored(self, rid: str) -> bool:
        deadline = time.monotonic() + self.store_wait
        pause = 0.0005
        while rid not in self._completed:
            self._poll()
            if rid in self._completed:
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)  # back off: polling must not starve the agents of CPU
            pause = min(pause * 2, 0.02)
        self._completed.discard(rid)
        return True

    def close(self) -> None:
        """Close the client and free the shared buffers."""
        self.client.close()
        self.planes = []
        self.bufs.close()


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50 / p99 in milliseconds (0 for no samples)."""
    if not samples:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "count": 0}
    arr = np.asarray(samples) * 1e3
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99)),
            "count": len(samples)}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one engine rank (the demo runner starts one per PP stage)."""
    p = argparse.ArgumentParser(prog="python -m node_agent.demo.engine")
    p.add_argument("--socket", required=True)
    p.add_argument("--replica", default="demo-0")
    p.add_argument("--pp-rank", type=int, default=0)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--layout", required=True, help="layout as JSON (wire form)")
    p.add_argument("--num-slots", type=int, required=True)
    p.add_argument("--workload", required=True, help="WorkloadSpec fields as JSON")
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args(argv)

    from node_agent.engine_api.protocol import parse_layout

    layout = parse_layout(json.loads(args.layout))
    spec = WorkloadSpec(**json.loads(args.workload))
    rank = RankInfo(replica=args.replica, pp_rank=args.pp_rank, pp_size=args.pp_size)
    engine = DemoEngine(EngineClient(args.socket, rank, timeout=args.timeout), layout,
                        args.num_slots, store_wait=args.timeout)
    try:
        engine.register()
        # Wait for the runner's go (it waits until every agent answers /readyz 200).
        print(json.dumps({"registered": args.pp_rank}), flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        t0 = time.perf_counter()
        for i, req in enumerate(generate(spec), 1):
            engine.serve(req)
            print(json.dumps({"progress": i, "total": spec.requests}), flush=True)
        wall = time.perf_counter() - t0
        result = {"rank": args.pp_rank, "wall_seconds": wall, **engine.counts,
                  "latency": {op: percentiles(v) for op, v in engine.latencies.items()}}
        print(json.dumps({"result": result}), flush=True)
        return 0
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())

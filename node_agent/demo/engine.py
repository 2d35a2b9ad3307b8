"""A synthetic engine rank (its own process): shared-memory KV buffers, the client
library, and the demo workload.

Per request it does what an engine with a KV connector does: ``lookup`` the
prompt, ``retrieve`` the hit into fresh slots (and checks every loaded value
bit-exactly), "prefill" the rest by writing :func:`.workload.kv_values` into the
slots, ``store_kv`` prompt + reply, wait until ``poll_completed`` reports the
request (its slots are then free) and ``release`` it. It also counts the hit
tokens beyond the longest prefix it stored itself: those were stored by another
replica sharing its agent's tiers (``cross_hit_tokens``). When that wait times out
the request's slots are quarantined (the agent may still read them) until a
later ``poll_completed`` reports it; when no free run of slots is left the run
fails naming the quarantined requests.

Protocol with the runner, one JSON object per line on stdout:
``{"registered": rank}`` once the buffers are registered (then it waits for a
``go`` line on stdin), ``{"progress": i, "total": n}`` after each request, and
``{"result": {...}}`` with counts and per-call latencies.

With ``--replicas K`` one process runs K single-stage replicas of one model
(``<replica>-0`` ... ``<replica>-K-1``), each on its own thread with its own client
and buffers; request ``c<conv>-t<turn>`` goes to replica ``(conv + turn) % K``, so
each turn's prefix was stored by another replica, as behind a round-robin router.
Progress counts the requests of all K; there is one result line per replica.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Iterator, Sequence
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
                       "stored_tokens": 0, "mismatched_tokens": 0, "store_timeouts": 0,
                       "cross_hit_tokens": 0, "cross_hit_requests": 0}
        self._stored: list[np.ndarray] = []
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

    def own_prefix(self, prompt: np.ndarray) -> int:
        """Tokens of ``prompt`` (whole blocks) that start a sequence this engine stored:
        what its own stores can explain of a hit."""
        best = 0
        for seq in self._stored:
            n = min(len(seq), len(prompt))
            diff = np.flatnonzero(seq[:n] != prompt[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        return best - best % self.layout.tokens_per_block

    def serve(self, req: DemoRequest) -> None:
        """Run one request end to end."""
        full = req.full
        slots = self._slots(len(full))
        hit = int(self._timed("lookup", self.client.lookup, req.rid, req.prompt))
        cross = max(0, hit - self.own_prefix(req.prompt))
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
        self.counts["cross_hit_tokens"] += cross
        self.counts["cross_hit_requests"] += cross > 0
        self._stored.append(full)

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


def routed(spec: WorkloadSpec, index: int, count: int) -> Iterator[DemoRequest]:
    """The requests replica ``index`` of ``count`` serves: turn ``t`` of conversation
    ``c`` goes to replica ``(c + t) % count``, so a conversation's next turn (whose
    prompt repeats this turn) lands on the next replica."""
    for req in generate(spec):
        if (req.conversation + req.turn) % count == index:
            yield req


def _model_digest(name: str) -> str:
    from node_agent.engine_api.identity import ModelIdentity

    return ModelIdentity(served_name=name, model=f"/models/{name}").digest() if name else ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one engine rank, or ``--replicas`` single-stage replicas (the demo runner
    starts one process per PP stage and one per node's replicas)."""
    p = argparse.ArgumentParser(prog="python -m node_agent.demo.engine")
    p.add_argument("--socket", required=True)
    p.add_argument("--replica", default="demo-0")
    p.add_argument("--pp-rank", type=int, default=0)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1,
                   help="single-stage replicas in this process, named <replica>-<i>")
    p.add_argument("--model", default="", help="model name the ranks send (its digest)")
    p.add_argument("--layout", required=True, help="layout as JSON (wire form)")
    p.add_argument("--num-slots", type=int, required=True)
    p.add_argument("--workload", required=True, help="WorkloadSpec fields as JSON")
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.replicas < 1 or (args.replicas > 1 and args.pp_size != 1):
        p.error(f"--replicas {args.replicas}: give 1, or more only with --pp-size 1")

    from node_agent.engine_api.protocol import parse_layout

    layout = parse_layout(json.loads(args.layout))
    spec = WorkloadSpec(**json.loads(args.workload))
    model = _model_digest(args.model)
    names = ([args.replica] if args.replicas == 1 else
             [f"{args.replica}-{i}" for i in range(args.replicas)])
    engines = [DemoEngine(EngineClient(args.socket, RankInfo(
        replica=name, pp_rank=args.pp_rank, pp_size=args.pp_size, model=model),
        timeout=args.timeout), layout, args.num_slots, store_wait=args.timeout)
        for name in names]
    lock = threading.Lock()
    done = [0]
    failures: list[str] = []

    def run(i: int) -> dict[str, Any] | None:
        engine = engines[i]
        t0 = time.perf_counter()
        try:
            for req in routed(spec, i, len(engines)):
                engine.serve(req)
                with lock:
                    done[0] += 1
                    print(json.dumps({"progress": done[0], "total": spec.requests}),
                          flush=True)
        except Exception as exc:
            with lock:
                failures.append(f"{names[i]}: {type(exc).__name__}: {exc}")
            return None
        return {"rank": args.pp_rank, "replica": names[i],
                "wall_seconds": time.perf_counter() - t0, **engine.counts,
                "latency": {op: percentiles(v) for op, v in engine.latencies.items()}}

    try:
        for engine in engines:
            engine.register()
        # Wait for the runner's go (it waits until every agent answers /readyz 200).
        print(json.dumps({"registered": args.pp_rank}), flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        results: list[dict[str, Any] | None] = [None] * len(engines)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(i)),
                                    name=f"replica-{i}") for i in range(len(engines))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for result in results:
            if result is not None:
                print(json.dumps({"result": result}), flush=True)
        if failures:
            print(json.dumps({"error": "; ".join(failures)}), flush=True)
            return 1
        return 0
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    finally:
        for engine in engines:
            engine.close()


if __name__ == "__main__":
    sys.exit(main())

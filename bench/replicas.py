"""Several engines on one agent: N = 1, 2, 4, 8 single-stage replicas of one model
share one agent process (``maxStages: N``, ``tierShares: 1``: one shared backend),
each a synthetic engine in its own process talking to the agent over the real
engine socket
(:class:`node_agent.client.EngineClient`, shared-memory KV buffers, as in
``bench/engine_api.py``).

Per N a fresh agent is started (its CPU tier sized N x the per-engine share, so
every engine's share is the same), then, all engines at once, phase by phase
(each phase starts when every engine finished the previous one):

* ``store``: each engine stores its own ``--prefixes`` prompts of ``--tokens``
  tokens and waits for their completion;
* ``load``: each engine loads its own prompts ``--rounds`` times (``lookup`` +
  ``retrieve`` + ``release``), timing every ``lookup``; aggregate load GB/s is
  the KV bytes all engines loaded over the phase's wall time (first start to
  last end);
* ``load_engine``: the same loads, each copied by the engine itself from the
  agent's shared CPU tier (:class:`node_agent.engine_loads.EngineLoads`):
  aggregate GB/s against N = 1 of this phase and against the ``load`` phase;
* ``lookups``: each engine looks its own prompts up ``--rounds`` times without
  loading them (``lookup`` + ``release``, every ``lookup`` timed): the lookup's
  latency with N engines but no copies in the agent, and the lookups per second
  the agent answered (all engines, over the phase's wall time): the closed-loop
  capacity;
* ``paced``: each engine issues ``--paced-requests`` ``lookup`` + ``release``
  pairs of its own prompts at ``--lookup-rate`` per second (open loop, as an
  engine that looks
  up once per admitted request: send times are scheduled in advance from one
  start time shared by all engines, each engine at its own seeded offset within
  the period, and each ``lookup`` is timed from its scheduled time, so time
  spent queued behind a late earlier request counts), all engines at once: the
  lookup's latency at an engine's pace, comparable with the closed-loop capacity
  of the ``lookups`` phase (loading each hit as well would offer N x rate x 8 MiB
  per second of copies, more than the agent's aggregate load rate at N = 8);
* ``shared``: a shared-prefix workload: each engine looks up every other
  engine's prompts followed by a suffix of its own, and loads what hits; the
  cross-replica hit rate is the hit tokens over the other engines' prompt
  tokens, as the engines observed them (0 while replicas do not share tiers).

Every loaded token is checked bit-exactly against the KV the prompt's tokens
stand for (a function of token id, position and plane, the same for every
replica of the model). One JSON object per result: ``replicas_load`` (aggregate
GB/s, ratio against N = 1 in the same run, goal >= 0.8),
``replicas_load_engine_copy`` (the same for ``load_engine``, its ratio over
``replicas_load`` at the same N, and the share of its loads the claim fence
showed held, whose commits went out without waiting),
``replicas_lookup`` (p50/p99 ms during the load phase, ratio against N = 1, goal
p99 <= 2x), ``replicas_lookup_only`` (the same in the ``lookups`` phase, with the lookups
per second the agent answered), ``replicas_lookup_paced`` (the same in the
``paced`` phase, goal p99 <= 2x, with the offered total rate against the
closed-loop capacity of the ``lookups`` phase) and ``replicas_cross_hits`` (hit
rate on the shared-prefix workload).

    python -P bench/replicas.py            # N = 1, 2, 4, 8 (about three minutes on 2 cores)
    python -P bench/replicas.py --quick    # N = 1, 2, small prompts (smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

MODEL = "bench-llm"


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def layout_of(args: argparse.Namespace) -> Any:
    from node_agent.vocab.layout import KVDtype, KVLayout

    return KVLayout(num_layers=args.layers, num_kv_heads=8, head_size=128,
                    dtype=KVDtype.FLOAT16, tokens_per_block=16)


def prompt(engine: int, k: int, tokens: int) -> np.ndarray:
    """Prompt ``k`` of ``engine``: token ids no other engine's prompt starts with."""
    return np.arange(tokens, dtype=np.int64) + (engine * 64 + k) * 100_000


# -- one engine (its own process) -----------------------------------------------------


def engine_main(cfg: dict[str, Any]) -> int:
    """An engine process: register, then run each phase when stdin names it; one
    JSON line per phase on stdout."""
    import torch

    from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
    from node_agent.demo.workload import kv_values
    from node_agent.engine_api.identity import ModelIdentity
    from node_agent.engine_api.protocol import parse_layout
    from node_agent.engine_loads import EngineLoads

    layout = parse_layout(cfg["layout"])
    me, n, tokens, prefixes = cfg["index"], cfg["engines"], cfg["tokens"], cfg["prefixes"]
    suffix = layout.tokens_per_block
    digest = ModelIdentity(served_name=MODEL, model=f"/models/{MODEL}").digest()
    client = EngineClient(cfg["socket"], RankInfo(f"rep-{me}", model=digest),
                          timeout=75)  # above the agent's call bound
    num_slots = 2 * (tokens + suffix)
    bufs = SharedKVBuffers.for_layout(layout, num_slots)
    planes = [t.view(num_slots, -1) for group in bufs.tensors for t in group]
    ints = {2: torch.int16, 4: torch.int32}[planes[0].element_size()]
    bits = [p.view(ints) for p in planes]
    src = np.arange(tokens + suffix, dtype=np.int64)
    dst = np.arange(tokens + suffix, 2 * (tokens + suffix), dtype=np.int64)

    def write(ids: np.ndarray, slots: np.ndarray) -> None:
        idx = torch.from_numpy(slots)
        for p, b in enumerate(bits):
            vals = kv_values(ids, 0, p, planes[p].dtype).view(ints)
            b[idx] = vals.view(-1, 1).expand(-1, b.shape[1])

    def mismatched(ids: np.ndarray, slots: np.ndarray) -> int:
        idx = torch.from_numpy(slots)
        bad = torch.zeros(len(slots), dtype=torch.bool)
        for p, b in enumerate(bits):
            want = kv_values(ids, 0, p, planes[p].dtype).view(ints).view(-1, 1)
            bad |= b[idx].ne(want).any(dim=1)
        return int(bad.sum())

    def wait_stored(rid: str) -> None:
        deadline = time.monotonic() + 60
        while rid not in client.wait_completed(1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"store {rid} did not complete within 60 s")

    def say(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    try:
        client.register_kv_buffers(layout, bufs.handles)
        say(registered=me)
        bad = 0
        for line in sys.stdin:
            phase, *rest = line.split()
            if phase == "store":
                for k in range(prefixes):
                    ids = prompt(me, k, tokens)
                    write(ids, src[:tokens])
                    if client.store_kv(f"s{k}", ids, src[:tokens]) < 0:
                        raise RuntimeError("store_kv stored nothing; is the tier large enough?")
                    wait_stored(f"s{k}")
                    client.release(f"s{k}")
                say(phase="store")
            elif phase == "load":
                lookups: list[float] = []
                loaded_tokens = 0
                t_start = time.monotonic()
                for r in range(cfg["rounds"]):
                    for k in range(prefixes):
                        ids, rid = prompt(me, k, tokens), f"l{r}-{k}"
                        t0 = time.perf_counter()
                        hit = client.lookup(rid, ids)
                        lookups.append(time.perf_counter() - t0)
                        loaded = client.retrieve(rid, dst[:hit]) if hit else 0
                        client.release(rid)
                        if loaded != tokens:
                            raise RuntimeError(f"loaded {loaded} of its own {tokens} tokens")
                        loaded_tokens += loaded
                t_end = time.monotonic()
                bad += mismatched(prompt(me, prefixes - 1, tokens), dst[:tokens])
                say(phase="load", start=t_start, end=t_end, loaded_tokens=loaded_tokens,
                    lookup_s=lookups)
            elif phase == "load_engine":
                # The same loads, each copied by this engine from the agent's shared
                # CPU tier (lookup_claim, the copy, the claim fence or commit_load).
                loads = EngineLoads(client, layout, bufs.tensors)
                for p in planes:
                    p[int(dst[0]):].zero_()
                loaded_tokens = 0
                t_start = time.monotonic()
                for r in range(cfg["rounds"]):
                    for k in range(prefixes):
                        ids, rid = prompt(me, k, tokens), f"e{r}-{k}"
                        hit = loads.lookup(rid, ids)
                        got = loads.load(rid, dst[:hit]) if hit else 0
                        if got is None:
                            raise RuntimeError("the agent did not hand the load out")
                        if got != tokens:
                            raise RuntimeError(f"engine copy loaded {got} of {tokens} tokens")
                        loaded_tokens += got
                t_end = time.monotonic()
                loads.close()
                bad += mismatched(prompt(me, prefixes - 1, tokens), dst[:tokens])
                say(phase="load_engine", start=t_start, end=t_end, loaded_tokens=loaded_tokens,
                    loads=loads.loads, fenced=loads.fenced)
            elif phase == "lookups":
                lookups = []
                t_start = time.monotonic()
                for r in range(cfg["rounds"]):
                    for k in range(prefixes):
                        ids, rid = prompt(me, k, tokens), f"q{r}-{k}"
                        t0 = time.perf_counter()
                        hit = client.lookup(rid, ids)
                        lookups.append(time.perf_counter() - t0)
                        client.release(rid)
                        if hit != tokens:
                            raise RuntimeError(f"its own prompt hit {hit} of {tokens} tokens")
                say(phase="lookups", start=t_start, end=time.monotonic(), lookup_s=lookups)
            elif phase == "paced":
                # Open loop: request i is due at start + phase + i / rate whatever the
                # earlier ones took; its lookup is timed from that due time. Each
                # engine's phase within the period is drawn (seeded by its index), so
                # the engines are neither in lockstep nor perfectly interleaved.
                period = 1.0 / cfg["lookup_rate"]
                start = float(rest[0]) + np.random.default_rng(me).uniform(0, period)
                lookups = []
                for i in range(cfg["paced_requests"]):
                    due = start + i * period
                    ahead = due - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                    k = i % prefixes
                    ids, rid = prompt(me, k, tokens), f"p{i}"
                    hit = client.lookup(rid, ids)
                    lookups.append(time.monotonic() - due)
                    client.release(rid)
                    if hit != tokens:
                        raise RuntimeError(f"its own prompt hit {hit} of {tokens} tokens")
                say(phase="paced", start=start, end=time.monotonic(), lookup_s=lookups)
            elif phase == "shared":
                others = [j for j in range(n) if j != me]
                hit_tokens = looked = cross_requests = 0
                for j in others:
                    for k in range(prefixes):
                        ids = np.concatenate([prompt(j, k, tokens),
                                              prompt(me, 63, suffix) + 99_000])
                        rid = f"x{j}-{k}"
                        hit = client.lookup(rid, ids)
                        looked += tokens
                        if hit:
                            loaded = client.retrieve(rid, dst[:hit])
                            if loaded:
                                bad += mismatched(ids[:loaded], dst[:loaded])
                            hit_tokens += loaded
                            cross_requests += loaded > 0
                        client.release(rid)
                say(phase="shared", hit_tokens=hit_tokens, other_prompt_tokens=looked,
                    cross_hit_requests=cross_requests, mismatched_tokens=bad)
                return 0
        return 1
    except Exception as exc:
        say(error=f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        client.close()
        bufs.close()


# -- the run ---------------------------------------------------------------------------


class Run:
    """An agent with ``maxStages: n`` (one tier share) and ``n`` engine processes."""

    def __init__(self, args: argparse.Namespace, n: int, work: Path) -> None:
        from node_agent.engine_api.protocol import layout_to_wire

        self.n, self.work = n, work
        layout = layout_of(args)
        share = 2 * args.prefixes * args.tokens * layout.bytes_per_token
        port = free_port()
        self.sock = str(work / "engine.sock")
        # One model: its replicas share one backend, which holds the whole budget.
        cfg = {"pool": "bench", "tokensPerBlock": layout.tokens_per_block, "maxStages": n,
               "tierShares": 1,
               "tiers": {"cpu": {"size": n * share, "pinned": False}},
               "ports": {"http": port, "fanout": free_port()}, "engineSocket": self.sock,
               "nodeName": "bench", "bindAddress": "127.0.0.1", "kubernetes": "off",
               "timeouts": {"engineCallSeconds": 60}}
        (work / "agent.yaml").write_text(json.dumps(cfg))
        self.log: IO[bytes] = (work / "agent.log").open("wb")
        self.agent = subprocess.Popen([sys.executable, "-m", "node_agent", "run", "--config",
                                       str(work / "agent.yaml")],
                                      stdout=self.log, stderr=self.log)
        self.engines: list[subprocess.Popen[str]] = []
        self._wait_healthy(f"http://127.0.0.1:{port}")
        for i in range(n):
            ecfg = {"socket": self.sock, "index": i, "engines": n, "tokens": args.tokens,
                    "prefixes": args.prefixes, "rounds": args.rounds,
                    "lookup_rate": args.lookup_rate, "paced_requests": args.paced_requests,
                    "layout": layout_to_wire(layout)}
            self.engines.append(subprocess.Popen(
                [sys.executable, "-P", __file__, "--engine", json.dumps(ecfg)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        self.bytes_per_token = layout.bytes_per_token
        for e in self.engines:
            self._line(e)

    def _wait_healthy(self, url: str) -> None:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.agent.poll() is not None:
                raise RuntimeError(f"the agent exited; see {self.work / 'agent.log'}")
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the agent did not start within 120 s; see {self.work}")

    @staticmethod
    def _line(e: subprocess.Popen[str]) -> dict[str, Any]:
        assert e.stdout is not None
        line = e.stdout.readline()  # bounded: every engine call has a timeout
        if not line:
            raise RuntimeError(f"an engine exited with {e.wait(timeout=30)}")
        msg: dict[str, Any] = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"an engine failed: {msg['error']}")
        return msg

    def phase(self, name: str, *params: str) -> list[dict[str, Any]]:
        """Start phase ``name`` (with ``params``) on every engine at once; each
        engine's report."""
        for e in self.engines:
            assert e.stdin is not None
            e.stdin.write(" ".join((name, *params)) + "\n")
            e.stdin.flush()
        return [self._line(e) for e in self.engines]

    def close(self) -> None:
        for e in self.engines:  # an engine ends after its last phase (or at stdin's end)
            if e.stdin is not None:
                e.stdin.close()
        for e in self.engines:
            try:
                e.wait(timeout=30)
            except subprocess.TimeoutExpired:
                e.kill()
                e.wait(timeout=30)
        self.agent.terminate()
        try:
            self.agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.agent.wait(timeout=10)
        self.log.close()


def measure(args: argparse.Namespace, n: int) -> dict[str, Any]:
    """One N: aggregate load GB/s, lookup latencies and the cross-replica hit rate."""
    work = Path(tempfile.mkdtemp(prefix="fkv-replicas-"))
    run = Run(args, n, work)
    try:
        run.phase("store")
        loads = run.phase("load")
        engine_loads = run.phase("load_engine")
        only = run.phase("lookups")
        # One start time for all engines (CLOCK_MONOTONIC is system-wide), far
        # enough ahead for every engine to have read its line.
        paced = run.phase("paced", repr(time.monotonic() + 0.5))
        shared = run.phase("shared")
    finally:
        run.close()
    shutil.rmtree(work, ignore_errors=True)
    wall = max(r["end"] for r in loads) - min(r["start"] for r in loads)
    loaded = sum(r["loaded_tokens"] for r in loads) * run.bytes_per_token
    lookups = np.asarray([s for r in loads for s in r["lookup_s"]]) * 1e3
    alone = np.asarray([s for r in only for s in r["lookup_s"]]) * 1e3
    at_pace = np.asarray([s for r in paced for s in r["lookup_s"]]) * 1e3
    bad = sum(r["mismatched_tokens"] for r in shared)
    if bad:
        raise RuntimeError(f"{bad} loaded tokens of N = {n} engines hold wrong KV")
    others = sum(r["other_prompt_tokens"] for r in shared)
    ewall = max(r["end"] for r in engine_loads) - min(r["start"] for r in engine_loads)
    eloaded = sum(r["loaded_tokens"] for r in engine_loads) * run.bytes_per_token
    return {"gbps": loaded / wall / 1e9, "bytes": loaded, "seconds": wall,
            "engine_gbps": eloaded / ewall / 1e9,
            "fenced_share": sum(r["fenced"] for r in engine_loads)
            / max(1, sum(r["loads"] for r in engine_loads)),
            "bytes_per_token": run.bytes_per_token,
            "p50_ms": float(np.percentile(lookups, 50)),
            "p99_ms": float(np.percentile(lookups, 99)), "lookups": len(lookups),
            "only_p50_ms": float(np.percentile(alone, 50)),
            "only_p99_ms": float(np.percentile(alone, 99)), "only_lookups": len(alone),
            "only_per_s": len(alone) / (max(r["end"] for r in only)
                                        - min(r["start"] for r in only)),
            "paced_p50_ms": float(np.percentile(at_pace, 50)),
            "paced_p99_ms": float(np.percentile(at_pace, 99)), "paced_lookups": len(at_pace),
            "paced_per_s": len(at_pace) / (max(r["end"] for r in paced)
                                           - min(r["start"] for r in paced)),
            "cross_hit_tokens": sum(r["hit_tokens"] for r in shared),
            "cross_hit_requests": sum(r["cross_hit_requests"] for r in shared),
            "other_prompt_tokens": others}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N = 1, 2 and small prompts (smoke)")
    p.add_argument("--engines", default=None, help="comma-separated N values (default 1,2,4,8)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per prompt (default 512)")
    p.add_argument("--prefixes", type=int, default=2, help="prompts per engine, default 2")
    p.add_argument("--rounds", type=int, default=None, help="load rounds (default 60)")
    p.add_argument("--layers", type=int, default=None, help="layers (default 4)")
    p.add_argument("--lookup-rate", type=float, default=50.0,
                   help="paced phase: lookups per second per engine (default 50)")
    p.add_argument("--paced-requests", type=int, default=None,
                   help="paced phase: lookups per engine (default 400; --quick: 6)")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        return engine_main(json.loads(args.engine))
    counts = [int(x) for x in (args.engines or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    if not counts or counts[0] != 1 or any(c < 1 for c in counts):
        p.error(f"--engines {args.engines!r}: give counts >= 1 starting with 1 (the baseline)")
    if not args.lookup_rate > 0:
        p.error(f"--lookup-rate {args.lookup_rate}: give a rate > 0 lookups per second")
    if args.paced_requests is None:
        args.paced_requests = 6 if args.quick else 400
    if args.paced_requests < 1:
        p.error(f"--paced-requests {args.paced_requests}: give at least 1 lookup per engine")
    args.tokens = args.tokens or (64 if args.quick else 512)
    args.rounds = args.rounds or (3 if args.quick else 60)
    args.layers = args.layers or (1 if args.quick else 4)
    base: dict[str, Any] = {}
    for n in counts:
        got = measure(args, n)
        base = base or got
        load = [round(x, 2) for x in os.getloadavg()]
        emit(bench="replicas_load", engines=n, tokens=args.tokens, prefixes=args.prefixes,
             rounds=args.rounds, bytes=got["bytes"], bytes_per_token=got["bytes_per_token"],
             seconds=round(got["seconds"], 4),
             gbps=round(got["gbps"], 3), baseline="1_engine",
             baseline_gbps=round(base["gbps"], 3), ratio=round(got["gbps"] / base["gbps"], 3),
             goal_ratio=0.8, loadavg=load)
        emit(bench="replicas_load_engine_copy", engines=n, tokens=args.tokens,
             prefixes=args.prefixes, rounds=args.rounds, gbps=round(got["engine_gbps"], 3),
             baseline="1_engine", baseline_gbps=round(base["engine_gbps"], 3),
             ratio=round(got["engine_gbps"] / base["engine_gbps"], 3),
             agent_copy_gbps=round(got["gbps"], 3),
             over_agent_copy=round(got["engine_gbps"] / got["gbps"], 3),
             held_by_fence=round(got["fenced_share"], 3), loadavg=load)
        for name, pre, count in (("replicas_lookup", "", "lookups"),
                                 ("replicas_lookup_only", "only_", "only_lookups"),
                                 ("replicas_lookup_paced", "paced_", "paced_lookups")):
            extra: dict[str, Any] = {}
            if pre == "only_":
                extra = {"aggregate_lookups_per_s": round(got["only_per_s"], 1)}
            elif pre == "paced_":
                extra = {"lookup_rate_per_engine": args.lookup_rate,
                         "requests_per_engine": args.paced_requests,
                         "offered_lookups_per_s": round(n * args.lookup_rate, 1),
                         "answered_lookups_per_s": round(got["paced_per_s"], 1),
                         "closed_loop_capacity_per_s": round(got["only_per_s"], 1),
                         "offered_to_capacity": round(n * args.lookup_rate
                                                      / got["only_per_s"], 3)}
            for q in ("p50", "p99"):
                key = f"{pre}{q}_ms"
                emit(bench=name, engines=n, percentile=q, samples=got[count],
                     ms=round(got[key], 4), baseline="1_engine", baseline_ms=round(base[key], 4),
                     ratio=round(got[key] / base[key], 3),
                     goal_ratio_max=2.0 if q == "p99" and pre != "only_" else None,
                     loadavg=load, **extra)
        if n > 1:
            emit(bench="replicas_cross_hits", engines=n,
                 hit_rate=round(got["cross_hit_tokens"] / max(got["other_prompt_tokens"], 1), 4),
                 hit_tokens=got["cross_hit_tokens"],
                 other_prompt_tokens=got["other_prompt_tokens"],
                 hit_requests=got["cross_hit_requests"], loadavg=load)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine API benchmark: what an engine rank pays for reaching its agent over the
local socket, against baselines measured in the same run.

An agent runs as its own process (``python -m node_agent run``, embedded backend,
one stage); this process is the engine: it registers shared-memory KV buffers
through :class:`node_agent.client.EngineClient` and then measures

* ``store``: ``store_kv`` of a fresh prompt plus waiting until the agent reports
  it (``wait_completed``), as GB/s of KV bytes; baseline: a plain torch ``copy_``
  of the same bytes from the same shared-memory planes into preallocated
  tensors as cold as the tier blocks a store fills (the slots are contiguous,
  so this is the memcpy best case), interleaved round by round; ``ratio`` is
  the median of the per-round ratios (see ``bench_bandwidth``);
* ``load``: ``lookup`` plus ``retrieve`` of a cached prompt into other slots,
  GB/s; baseline: the plain ``copy_`` of the same bytes back into the planes;
* ``load_engine_copy``: the same load copied by this process from the agent's
  shared CPU tier (``lookup_claim``, the copy, the claim fence read, the commit
  sent without waiting: :class:`node_agent.engine_loads.EngineLoads`), same
  baseline; the slots it filled are checked bit for bit against the stored ones;
* ``load_engine_copy_answered``: the same, but every load waits for its
  ``commit_load`` answer (the fence ignored, as for an agent that hands none
  out), in the same rounds (which of the two goes first alternates);
  ``vs_fenced`` is the median per-round ratio of its time to the fenced load's;
* ``lookup``: p50/p99 of a fully hit ``lookup`` + ``release`` through the
  socket, the release sent without waiting (``release_nowait``, as the
  engine integrations send it); baseline: the same calls on an in-process
  connector holding the same blocks (what the engine would pay with the
  connector linked in); ``waited_ms``: the same with the release's answer
  waited for, alternated sample by sample with ours;
* ``ping``: p50/p99 of the agent's ``ping`` (transport, decoding; the agent's
  socket thread answers it itself); baselines: a bare pyzmq DEALER/ROUTER echo
  on an ipc socket in its own process (the engine-to-agent topology) and one in
  a thread of this process (one libzmq context for both ends), alternated call
  by call with ours.

This process runs libgomp (torch's OpenMP runtime) with a short spin count
(``GOMP_SPINCOUNT=2000``) unless the environment names a spin count or a wait
policy, which then also reaches the agent; the bandwidth rows record it as
``engine_omp`` (see the comment at the torch import).

Ratios are ours / baseline for bandwidth (higher is better) and baseline / ours
for latency (the share of the socket round trip's cost; higher is better).

    python bench/engine_api.py            # default run (about a minute on 2 cores)
    python bench/engine_api.py --quick    # smoke run (seconds)
"""

# ruff: noqa: E402  (torch is imported after the OpenMP spin count is set, below)
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# This process is the engine. Its torch baseline copies run on OpenMP workers
# that libgomp keeps spinning for ~8 ms after each copy (its default spin count);
# on two cores that took one from the agent and from the engine's own copy in
# the timed call that followed. A short spin (set here unless the environment
# names a spin count or wait policy) ends it within microseconds and moved the
# baseline's rate by less than 3% (its planes still run back to back on hot
# workers; README, "Benchmarks"). The agent this bench starts does not inherit
# it: the agent sets its own policy (node_agent.openmp).
_OMP_SET = not (os.environ.get("GOMP_SPINCOUNT") or os.environ.get("OMP_WAIT_POLICY"))
if _OMP_SET:
    os.environ["GOMP_SPINCOUNT"] = "2000"
import torch  # libgomp reads the spin count when torch loads it

ENGINE_OMP = " ".join(f"{k}={os.environ[k]}" for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
                      if os.environ.get(k))
"""The engine process's OpenMP settings, as each row records them."""
if _OMP_SET:
    del os.environ["GOMP_SPINCOUNT"]
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.stage_store import TierStore
from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.coordinator import Coordinator, CoordinatorConfig
from node_agent.engine_api import protocol
from node_agent.engine_loads import EngineLoads
from node_agent.pp.group import GroupViewSource
from node_agent.vocab.group_view import GroupMember, GroupView
from node_agent.vocab.layout import KVDtype, KVLayout

COLD_RING = 3
"""Staging sets the bandwidth baseline rotates through (see ``bench_bandwidth``)."""


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_agent(work: Path, layout: KVLayout, cpu_bytes: int) -> tuple[subprocess.Popen[bytes],
                                                                        str, str]:
    port = free_port()
    sock = str(work / "engine.sock")
    cfg = {"pool": "bench", "tokensPerBlock": layout.tokens_per_block,
           "tiers": {"cpu": {"size": cpu_bytes, "pinned": False}},
           "ports": {"http": port, "fanout": free_port()}, "engineSocket": sock,
           "nodeName": "bench", "bindAddress": "127.0.0.1", "kubernetes": "off",
           "timeouts": {"engineCallSeconds": 30}}
    (work / "agent.yaml").write_text(yaml.safe_dump(cfg))
    log = (work / "agent.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "node_agent", "run", "--config",
                             str(work / "agent.yaml")], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, sock, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("the agent did not start within 60 s; see " + str(work / "agent.log"))


def wait_stored(client: EngineClient, rid: str, timeout: float = 30.0) -> None:
    """Until the agent reports ``rid`` stored (its completion notification,
    ``wait_completed``, as an engine would use it)."""
    deadline = time.monotonic() + timeout
    while rid not in client.wait_completed(1.0):
        if time.monotonic() > deadline:
            raise TimeoutError(f"store {rid} did not complete")


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def planes_of(bufs: SharedKVBuffers) -> list[torch.Tensor]:
    return [t.view(t.shape[0], -1) for g in bufs.tensors for t in g]


def bench_bandwidth(client: EngineClient, bufs: SharedKVBuffers, layout: KVLayout,
                    tokens: int, rounds: int) -> None:
    """Store and load through the socket against a torch copy of the same bytes,
    interleaved round by round (which goes first alternates).

    Baseline (``torch_copy_same_bytes``): ``copy_`` of the same engine planes'
    slots into a destination as cold as the tier blocks a store fills (a ring of
    ``COLD_RING`` staging sets, each last written ``COLD_RING - 1`` rounds ago),
    and back for the load. ``ratio`` is the median of the per-round ratios
    (each listed in ``round_ratios``). ``warm_baseline_gbps`` is the previous
    baseline, kept for comparison: the faster of torch ``copy_`` and numpy
    ``copyto`` each round into one staging set reused every round (cache-warm).
    """
    planes = planes_of(bufs)
    np_planes = [p.view(torch.uint8).numpy() for p in planes]
    nbytes = tokens * layout.bytes_per_token
    rng = np.random.default_rng(0)
    src = np.arange(tokens, dtype=np.int64)
    dst = np.arange(tokens, 2 * tokens, dtype=np.int64)
    eng = np.arange(2 * tokens, 3 * tokens, dtype=np.int64)  # the engine copy's slots
    src0, dst0, eng0 = int(src[0]), int(dst[0]), int(eng[0])
    ring = [[torch.empty_like(p[:tokens]) for p in planes] for _ in range(COLD_RING)]
    for staging in ring:
        for st in staging:
            st.fill_(1)  # touch the pages before timing
    warm = ring[0]
    names = ("store", "load", "load_engine_copy", "load_engine_copy_answered")
    ours: dict[str, list[float]] = {n: [] for n in names}
    base: dict[str, list[float]] = {n: [] for n in names}
    warm_base: dict[str, list[float]] = {n: [] for n in names}
    loads = EngineLoads(client, layout, bufs.tensors)
    answered = AnsweredLoads(client, layout, bufs.tensors)

    def engine_load(r: int, ids: np.ndarray, name: str, via: EngineLoads) -> None:
        t0 = time.perf_counter()
        hit = via.lookup(f"{name}{r}", ids)
        copied = via.load(f"{name}{r}", eng[:hit])
        ours[name].append(time.perf_counter() - t0)
        if copied != tokens:
            raise RuntimeError(f"{name} loaded {copied} of {tokens} tokens (None: the "
                               "agent did not hand the load out)")
        for p in np_planes:  # numpy: no OpenMP workers left spinning into the next call
            if not np.array_equal(p[eng0:eng0 + tokens], p[src0:src0 + tokens]):
                raise RuntimeError(f"{name}: the engine copy's slots differ from the stored KV")
            # Zeroed for the next check; the copies before it evict these lines
            # again, so the next copy writes memory as cold as this one did.
            p[eng0:eng0 + tokens] = 0
        client.release(f"{name}{r}")

    def run_ours(r: int, ids: np.ndarray) -> None:
        t0 = time.perf_counter()
        if client.store_kv(f"s{r}", ids, src) < 0:
            raise RuntimeError("store_kv stored nothing; is the tier large enough?")
        wait_stored(client, f"s{r}")
        ours["store"].append(time.perf_counter() - t0)
        client.release(f"s{r}")
        t0 = time.perf_counter()
        hit = client.lookup(f"l{r}", ids)
        loaded = client.retrieve(f"l{r}", dst[:hit])
        ours["load"].append(time.perf_counter() - t0)
        client.release(f"l{r}")
        if loaded != tokens:
            raise RuntimeError(f"loaded {loaded} of {tokens} tokens")
        pair = [("load_engine_copy", loads), ("load_engine_copy_answered", answered)]
        for name, via in pair if r % 2 == 0 else pair[::-1]:
            engine_load(r, ids, name, via)

    def run_base(r: int) -> None:
        pairs = list(zip(planes, ring[r % COLD_RING], strict=True))
        base["store"].append(timed(lambda: [s.copy_(p[src0:src0 + tokens]) for p, s in pairs]))
        base["load"].append(timed(lambda: [p[dst0:dst0 + tokens].copy_(s) for p, s in pairs]))
        base["load_engine_copy"].append(base["load"][-1])
        base["load_engine_copy_answered"].append(base["load"][-1])
        wp = list(zip(planes, warm, strict=True))
        warm_base["store"].append(min(
            timed(lambda: [s.copy_(p[src0:src0 + tokens]) for p, s in wp]),
            timed(lambda: [np.copyto(s.numpy(), p[src0:src0 + tokens].numpy())
                           for p, s in wp])))
        warm_base["load"].append(min(
            timed(lambda: [p[dst0:dst0 + tokens].copy_(s) for p, s in wp]),
            timed(lambda: [np.copyto(p[dst0:dst0 + tokens].numpy(), s.numpy())
                           for p, s in wp])))
        warm_base["load_engine_copy"].append(warm_base["load"][-1])
        warm_base["load_engine_copy_answered"].append(warm_base["load"][-1])

    for r in range(rounds):
        ids = rng.integers(0, 1 << 30, tokens, dtype=np.int64)
        if r % 2:
            run_base(r)
            run_ours(r, ids)
        else:
            run_ours(r, ids)
            run_base(r)
    load = [round(x, 2) for x in os.getloadavg()]
    loads.close()
    answered.close()
    if loads.fenced != rounds or answered.fenced:
        raise RuntimeError(f"{loads.fenced} of {rounds} loads held by the fence (want all), "
                           f"{answered.fenced} of the answered ones (want none)")
    for name in names:
        o, b, w = ours[name], base[name], warm_base[name]
        ratios = sorted(bb / oo for oo, bb in zip(o, b, strict=True))
        ours_gbps = nbytes / statistics.median(o) / 1e9
        extra: dict[str, Any] = {}
        if name == "load_engine_copy_answered":
            extra["vs_fenced"] = round(statistics.median(
                a / f for a, f in zip(o, ours["load_engine_copy"], strict=True)), 3)
        emit(bench="engine_api_bandwidth", direction=name, tokens=tokens, bytes=nbytes, **extra,
             rounds=rounds, gbps=round(ours_gbps, 3), baseline="torch_copy_same_bytes",
             goal_ratio=0.8, baseline_gbps=round(nbytes / statistics.median(b) / 1e9, 3),
             ratio=round(statistics.median(ratios), 3),
             round_ratios=[round(x, 3) for x in ratios],
             warm_baseline_gbps=round(nbytes / statistics.median(w) / 1e9, 3),
             ratio_vs_warm=round(statistics.median(w) / statistics.median(o), 3),
             engine_omp=ENGINE_OMP, loadavg=load)


class AnsweredLoads(EngineLoads):
    """Engine-side loads that always wait for their commit's answer, as against an
    agent that hands out no claim fence (the bench's comparison)."""

    def _held_by_fence(self, got: dict[str, Any]) -> bool:
        return False


def inprocess_connector(layout: KVLayout, cpu_bytes: int) -> Coordinator:
    me = GroupMember(node="bench", pp_rank=0, fanout_endpoint="")
    bcfg = EmbeddedBackendConfig(layout=layout, cpu_bytes=cpu_bytes, pinned=False,
                                 deferred_visibility=True)
    conn = Coordinator(CoordinatorConfig(group="bench-inproc", pp_rank=0, layout=layout),
                     GroupViewSource(GroupView("bench-inproc", 0, me, (me,))),
                     backend_factory=lambda: EmbeddedBackend(bcfg),
                     store_factory=lambda: TierStore(bcfg))
    return conn.start()


def bench_lookup(client: EngineClient, bufs: SharedKVBuffers, layout: KVLayout,
                 cpu_bytes: int, tokens: int, samples: int) -> None:
    ids = np.arange(7, 7 + tokens, dtype=np.int64)
    src = np.arange(tokens, dtype=np.int64)
    client.store_kv("lk", ids, src)
    wait_stored(client, "lk")
    client.release("lk")
    local = inprocess_connector(layout, cpu_bytes)
    local_bufs = SharedKVBuffers.for_layout(layout, 2 * tokens)
    try:
        local.register_kv_buffers(0, local_bufs.tensors)
        local.store_kv("lk", ids, src)
        deadline = time.monotonic() + 30
        while "lk" not in local.poll_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("in-process store did not complete")
            time.sleep(0.001)
        local.release("lk")
        ours, waited, base = [], [], []
        for i in range(samples):
            nowait_first = i % 2 == 0
            for nowait in (nowait_first, not nowait_first):
                t0 = time.perf_counter()
                assert client.lookup(f"q{i}{nowait}", ids) == tokens
                if nowait:
                    client.release_nowait(f"q{i}{nowait}")
                else:
                    client.release(f"q{i}{nowait}")
                (ours if nowait else waited).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert local.lookup(f"q{i}", ids) == tokens
            local.release(f"q{i}")
            base.append(time.perf_counter() - t0)
    finally:
        local.close()
        local_bufs.close()
    for q in (50, 99):
        o, b = pct(ours, q) * 1e3, pct(base, q) * 1e3
        emit(bench="engine_api_lookup", percentile=f"p{q}", tokens=tokens, samples=samples,
             ms=round(o, 4), baseline="in_process_connector", baseline_ms=round(b, 4),
             ratio=round(b / o, 3), goal_ms=1.0 if q == 99 else None,
             release="nowait", waited_ms=round(pct(waited, q) * 1e3, 4),
             loadavg=round(os.getloadavg()[0], 2))


_ECHO_PROCESS = """
import sys, zmq
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.bind(sys.argv[1])
print("ready", flush=True)
while True:
    msg = router.recv_multipart()
    if msg[-1] == b"stop":
        break
    router.send_multipart(msg)
"""


def bench_ping(client: EngineClient, work: Path, samples: int) -> None:
    """Transport alone: the agent's ``ping`` against two bare pyzmq ipc echoes (a
    ROUTER answering each message with itself, no decoding): one in its own
    process, the engine-to-agent topology (two processes, a libzmq I/O thread
    each), and one in a thread of this process, sharing one libzmq context with
    its dealer (one I/O thread for both ends: the cheapest ipc round trip
    pyzmq makes). The three alternate call by call so that background load
    hits them alike."""
    import threading

    import zmq

    ctx = zmq.Context()
    endpoint = f"ipc://{work / 'echo.sock'}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if router.poll(100):
                router.send_multipart(router.recv_multipart())

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    proc_endpoint = f"ipc://{work / 'echo-proc.sock'}"
    echo_proc = subprocess.Popen([sys.executable, "-c", _ECHO_PROCESS, proc_endpoint],
                                 stdout=subprocess.PIPE)
    assert echo_proc.stdout is not None
    echo_proc.stdout.readline()
    pctx = zmq.Context()  # its own context, as an engine's client has
    pdealer = pctx.socket(zmq.DEALER)
    pdealer.connect(proc_endpoint)
    msg = protocol.encode_request(1, "ping")
    ours: list[float] = []
    base: list[float] = []
    base_proc: list[float] = []

    def bare(sock: Any, into: list[float] | None) -> None:
        t0 = time.perf_counter()
        sock.send_multipart(msg)
        sock.recv_multipart()
        if into is not None:
            into.append(time.perf_counter() - t0)

    for _ in range(20):  # warm-up of every path
        client.ping()
        bare(dealer, None)
        bare(pdealer, None)
    for _ in range(samples):
        t0 = time.perf_counter()
        client.ping()
        ours.append(time.perf_counter() - t0)
        bare(pdealer, base_proc)
        bare(dealer, base)
    pdealer.send_multipart([b"stop"])
    echo_proc.wait(timeout=10)
    stop.set()
    t.join(timeout=2)
    for sock in (dealer, router, pdealer):
        sock.close(0)
    ctx.term()
    pctx.term()
    for q in (50, 99):
        o = pct(ours, q) * 1e3
        for name, samples_b in (("bare_pyzmq_echo_ipc_process", base_proc),
                                ("bare_pyzmq_echo_ipc_thread", base)):
            b = pct(samples_b, q) * 1e3
            emit(bench="engine_api_ping", percentile=f"p{q}", samples=len(ours),
                 ms=round(o, 4), baseline=name, baseline_ms=round(b, 4),
                 ratio=round(b / o, 3), ours_over_baseline=round(o / b, 3),
                 goal_ours_over_baseline=1.5 if q == 50 else None,
                 loadavg=round(os.getloadavg()[0], 2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    args = p.parse_args()
    layout = KVLayout(num_layers=8 if not args.quick else 2, num_kv_heads=8, head_size=128,
                      dtype=KVDtype.FLOAT16, tokens_per_block=16)
    tokens = 2048 if not args.quick else 256
    rounds = 12 if not args.quick else 3
    samples = 300 if not args.quick else 30
    ping_samples = 2000 if not args.quick else 100
    cpu_bytes = (rounds + 4) * tokens * layout.bytes_per_token
    work = Path(tempfile.mkdtemp(prefix="fkv-bench-"))
    proc, sock, _ = start_agent(work, layout, cpu_bytes)
    bufs = SharedKVBuffers.for_layout(layout, 3 * tokens)
    client = EngineClient(sock, RankInfo("bench-0"), timeout=45)  # above the call bound
    try:
        client.register_kv_buffers(layout, bufs.handles)
        for planes in planes_of(bufs):
            planes.copy_(torch.randn(planes.shape).to(planes.dtype))
        bench_bandwidth(client, bufs, layout, tokens, rounds)
        bench_lookup(client, bufs, layout, cpu_bytes, tokens, samples)
        bench_ping(client, work, ping_samples)
    finally:
        client.close()
        bufs.close()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""PP fan-out benchmark: leader decision -> every follower applied.

Measures, in one run and on the same machine:

* ``zmq-curve``: this project's stream (LeaderStream -> FollowerStream over
  CurveZMQ PUSH/PULL on loopback): encode once, send to each follower, decode
  with strict checks, order check, hand to the follower's decision mailbox;
* ``gloo-pickle``: the baseline SGLang uses today, torch.distributed gloo
  point-to-point ``send``/``recv`` of the pickled decision (size, then bytes),
  unpickled on the follower.

Latency: one decision at a time, from the leader's decision (before encoding
or pickling) to the moment the *last* follower applied it, measured one way
on the shared wall clock of this machine (each follower stamps its apply time;
the leader paces the next decision on a small ack, not timed); p50 / p99 over
the samples, with 1, 3 and 7 followers. Throughput: decisions streamed back
to back to 3 followers, timed until every follower applied the last.

The decision is a put over a 2K-block prompt (16 tokens per block): an
unmatched mask of 32768 tokens whose span covers 1792 blocks, and a plan of
1792 blocks in fragmented runs of 8. Ratios (ours / gloo) are the figures to
compare across machines. Prints one JSON object per result.

    python bench/fanout.py            # default run (about 1-2 minutes on 2 cores)
    python bench/fanout.py --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import random
import socket
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib

from node_agent.backend.replication import Direction
from node_agent.connector.tracking import Mailbox
from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import FanoutServer
from node_agent.pp.messages import Ack, Decision, Kind, Message, Op, Reset
from node_agent.pp.stream import FollowerStream, LeaderStream, StreamMetrics

GROUP = "bench"
TOKENS_PER_BLOCK = 16
BLOCKS = 2048
CACHED_BLOCKS = 256
RUN = 8
MAX_FOLLOWERS = 7


def make_decision(i: int) -> Decision:
    """The benchmark's put decision (see module docstring)."""
    mask = np.zeros(BLOCKS * TOKENS_PER_BLOCK, dtype=np.bool_)
    mask[CACHED_BLOCKS * TOKENS_PER_BLOCK:] = True
    rng = random.Random(42)
    starts = list(range(0, (BLOCKS - CACHED_BLOCKS) * 2, RUN * 2))
    rng.shuffle(starts)
    n_runs = (BLOCKS - CACHED_BLOCKS) // RUN
    runs = np.array([[0, s, RUN] for s in starts[:n_runs]], dtype=np.int64)
    return Decision(Direction.STORE, f"req-{i}", i, 1000 + i, mask, runs, None)


def decision_dict(d: Decision) -> dict[str, Any]:
    """The same decision as the Python objects SGLang pickles."""
    assert d.runs is not None
    blocks = np.concatenate([np.arange(s, s + c) for _, s, c in d.runs.tolist()])
    return {
        "rid": d.rid, "task_id": d.task_id, "active": True, "unmatched_mask": d.mask,
        "plan_tiers": np.zeros(len(blocks), dtype=np.uint8), "plan_blocks": blocks,
        "error": None, "sent_at": 0.0,
    }


def pickled_payload(d: Decision) -> bytes:
    """The pickled decision (what the gloo baseline sends)."""
    return pickle.dumps(decision_dict(d))


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": round(statistics.median(s) * 1e6, 1),
        "p99_us": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, 1),
        "samples": len(s),
    }


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps({"bench": "fanout", **obj}), flush=True)


# -- zmq-curve -----------------------------------------------------------------------


def zmq_follower(rank: int, keys: CurveKeys, pipe: Connection) -> None:
    """Follower process: a fan-out server, a stream that follows on request,
    and a mailbox as the decision consumer (as FollowerRole uses it)."""
    server = FanoutServer("tcp://127.0.0.1:0", keys).start()
    mailbox: Mailbox[Decision] = Mailbox(1 << 16)
    holder: dict[str, FollowerStream] = {}
    lags: dict[int, float] = {}

    def apply(msg: Message) -> None:
        d = msg.body
        if isinstance(d, Decision):
            mailbox.put((d.rid, Kind.PUT, d.n), d)
            mailbox.discard_rid(d.rid)
            if d.rid.startswith("L"):
                lags[d.n] = time.time() - msg.env.sent_at
            if d.rid.startswith("L") or d.rid == "END":
                holder["s"].send_ack(Ack(rank, d.rid, Kind.PUT, d.n, d.task_id, True))

    pipe.send(server.endpoint)
    while True:
        cmd = pipe.recv()
        if cmd[0] == "follow":
            if "s" in holder:
                holder["s"].close()
            s = FollowerStream(GROUP, rank, keys, StreamMetrics(GROUP, None), apply,
                               on_unsynced=lambda r: None, on_dropped=lambda m: None,
                               hello_interval=0.05, leader_timeout=5.0)
            holder["s"] = s
            server.register(GROUP, s.handle)
            s.follow(cmd[1], cmd[2])
            pipe.send(True)
        elif cmd[0] == "lags":
            pipe.send(dict(lags))
            lags.clear()
        else:
            break
    if "s" in holder:
        holder["s"].close()
    server.close()


class ZmqLeader:
    """Leader side: a LeaderStream plus a server for acks."""

    def __init__(self, keys: CurveKeys) -> None:
        self.keys = keys
        self.server = FanoutServer("tcp://127.0.0.1:0", keys).start()
        self.acks: dict[int, set[int]] = {}
        self.cond = threading.Condition()
        self.stream: LeaderStream | None = None

    def on_ack(self, ack: Ack) -> None:
        with self.cond:
            self.acks.setdefault(ack.n, set()).add(ack.rank)
            self.cond.notify_all()

    def start_epoch(self, epoch: int, followers: dict[int, str]) -> LeaderStream:
        if self.stream is not None:
            self.stream.close()
        stream = LeaderStream(GROUP, epoch, self.keys, StreamMetrics(GROUP, None),
                              flush=lambda r: stream.broadcast(Op.RESET, Reset(r)),
                              on_ack=self.on_ack, heartbeat_interval=0.2)
        stream.set_followers(followers)
        self.server.register(GROUP, stream.handle)
        self.stream = stream
        return stream

    def wait_acks(self, n: int, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.acks.get(n, ())) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"decision {n}: {self.acks.get(n)} of {count} acks")
                self.cond.wait(left)
            del self.acks[n]


def _relabel(d: Decision, rid: str, n: int) -> Decision:
    return Decision(d.direction, rid, n, d.task_id, d.mask, d.runs, d.error)


def bench_zmq(counts: list[int], samples: int, stream_n: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    keys = CurveKeys.generate()
    procs, pipes, endpoints = [], [], {}
    results: dict[str, Any] = {}
    leader = ZmqLeader(keys)
    try:
        for r in range(1, max(counts) + 1):
            a, b = ctx.Pipe()
            p = ctx.Process(target=zmq_follower, args=(r, keys, b), daemon=True)
            p.start()
            procs.append(p)
            pipes.append(a)
        for r, a in enumerate(pipes, start=1):
            if not a.poll(60):
                raise TimeoutError(f"zmq follower {r} did not start")
            endpoints[r] = a.recv()
        base = make_decision(0)
        for epoch, n in enumerate(counts, start=1):
            fol = {r: endpoints[r] for r in range(1, n + 1)}
            stream = leader.start_epoch(epoch, fol)
            for r in fol:
                pipes[r - 1].send(("follow", epoch, leader.server.endpoint))
                pipes[r - 1].recv()
            deadline = time.monotonic() + 10
            while not stream.all_synced():
                if time.monotonic() > deadline:
                    raise TimeoutError("followers did not sync")
                time.sleep(0.005)
            for i in range(samples + 20):
                stream.broadcast(Op.PUT, _relabel(base, "L", i))
                leader.wait_acks(i, n)
            per_follower = []
            for r in fol:
                pipes[r - 1].send(("lags",))
                per_follower.append(pipes[r - 1].recv())
            lat = [max(p[i] for p in per_follower) for i in range(20, samples + 20)]
            results[f"lat{n}"] = _stats(lat)
            if n == 3:
                ds = [_relabel(base, "T", i) for i in range(stream_n)]
                ds[-1] = _relabel(base, "END", stream_n - 1)
                t0 = time.perf_counter()
                for d in ds:
                    stream.broadcast(Op.PUT, d)
                leader.wait_acks(stream_n - 1, n, timeout=120)
                results["tput3"] = stream_n / (time.perf_counter() - t0)
    finally:
        for a in pipes:
            with contextlib.suppress(OSError):
                a.send(("stop",))
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        if leader.stream is not None:
            leader.stream.close()
        leader.server.close()
    return results


# -- gloo-pickle -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_worker(rank: int, world: int, port: int) -> None:
    """Follower rank: for each phase, receive (size, bytes), unpickle, ack."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    ctl = torch.zeros(3, dtype=torch.int64)
    ack = torch.zeros(1, dtype=torch.float64)
    size = torch.zeros(1, dtype=torch.int64)
    while True:
        dist.recv(ctl, src=0)
        n_followers, count, ack_every = (int(x) for x in ctl)
        if n_followers == 0:
            break
        if rank > n_followers:
            continue
        for i in range(count):
            dist.recv(size, src=0)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(buf, src=0)
            obj = pickle.loads(buf.numpy().tobytes())
            ack[0] = time.time() - obj["sent_at"]
            if ack_every or i == count - 1:
                dist.send(ack, dst=0)
    dist.destroy_process_group()


def bench_gloo(counts: list[int], samples: int, stream_n: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    world = max(counts) + 1
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=gloo_worker, args=(r, world, port), daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    results: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=world)
        obj = decision_dict(make_decision(0))
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        ack = torch.zeros(1, dtype=torch.float64)

        def send_decision(n: int) -> None:
            obj["sent_at"] = time.time()
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size[0] = data.numel()
            for r in range(1, n + 1):
                dist.send(size, dst=r)
                dist.send(data, dst=r)

        def phase(n: int, count: int, ack_every: bool) -> None:
            for r in range(1, world):
                dist.send(torch.tensor([n, count, int(ack_every)]), dst=r)

        for n in counts:
            phase(n, samples + 20, True)
            lat = []
            for i in range(samples + 20):
                send_decision(n)
                worst = 0.0
                for r in range(1, n + 1):
                    dist.recv(ack, src=r)
                    worst = max(worst, float(ack[0]))
                if i >= 20:
                    lat.append(worst)
            results[f"lat{n}"] = _stats(lat)
            if n == 3:
                phase(3, stream_n, False)
                t0 = time.perf_counter()
                for _ in range(stream_n):
                    send_decision(3)
                for r in range(1, 4):
                    dist.recv(ack, src=r)
                results["tput3"] = stream_n / (time.perf_counter() - t0)
        phase(0, 0, False)
        dist.destroy_process_group()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: few samples")
    ap.add_argument("--samples", type=int, default=None, help="latency samples per config")
    ap.add_argument("--stream", type=int, default=None, help="decisions in the throughput run")
    args = ap.parse_args(argv)
    counts = [1, 3] if args.quick else [1, 3, MAX_FOLLOWERS]
    samples = args.samples or (30 if args.quick else 400)
    stream_n = args.stream or (300 if args.quick else 5000)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    d = make_decision(0)
    from node_agent.pp.messages import Envelope, encode

    wire = sum(len(f) for f in encode(Envelope(Op.PUT, GROUP, 1, 1), d))
    emit({"metric": "payload_bytes", "impl": "zmq-curve", "bytes": wire})
    emit({"metric": "payload_bytes", "impl": "gloo-pickle", "bytes": len(pickled_payload(d))})
    ours = bench_zmq(counts, samples, stream_n)
    base = bench_gloo(counts, samples, stream_n)
    for n in counts:
        emit({"metric": "latency", "impl": "zmq-curve", "followers": n, **ours[f"lat{n}"]})
        emit({"metric": "latency", "impl": "gloo-pickle", "followers": n, **base[f"lat{n}"]})
        p50 = ours[f"lat{n}"]["p50_us"] / base[f"lat{n}"]["p50_us"]
        p99 = ours[f"lat{n}"]["p99_us"] / base[f"lat{n}"]["p99_us"]
        emit({"metric": "latency_ratio", "followers": n, "p50_ratio": round(p50, 3),
              "p99_ratio": round(p99, 3), "goal_p50_ratio": 0.5, "met": p50 <= 0.5})
    emit({"metric": "throughput", "impl": "zmq-curve", "followers": 3,
          "decisions_per_s": round(ours["tput3"]), "goal": 20000,
          "met": ours["tput3"] >= 20000})
    emit({"metric": "throughput", "impl": "gloo-pickle", "followers": 3,
          "decisions_per_s": round(base["tput3"])})
    emit({"metric": "throughput_ratio", "followers": 3,
          "ratio": round(ours["tput3"] / base["tput3"], 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

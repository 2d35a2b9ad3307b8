"""PP fan-out benchmark: leader decision -> every follower applied.

Measures, in one run and on the same machine:

* ``zmq-curve``: this project's stream (LeaderStream -> FollowerStream over
  CurveZMQ PUSH/PULL on loopback): encode once, send to each follower (a burst
  is coalesced into batch frames; a paced decision goes out alone at once),
  decode with strict checks, order check, hand to the follower's decision
  mailbox;
* ``gloo-pickle``: the baseline SGLang uses today, torch.distributed gloo
  point-to-point ``send``/``recv`` of the pickled decision (size, then bytes),
  unpickled on the follower.

Both implementations run side by side and are measured in alternating short
batches, so background load on a shared machine hits both alike.

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

from node_agent.coordinator.tracking import Mailbox
from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import FanoutServer
from node_agent.pp.messages import Ack, Decision, Kind, Message, Op, Reset
from node_agent.pp.stream import FollowerStream, LeaderStream, StreamMetrics
from node_agent.vocab.placement import Direction

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
                holder["s"].send_ack(Ack(rank, d.rid, Kind.PUT, d.n, d.task_id, True),
                                    msg.env.incarnation)

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


class ZmqBench:
    """Our stream: follower processes plus the leader side in this process."""

    def __init__(self, followers: int) -> None:
        ctx = mp.get_context("spawn")
        self.keys = CurveKeys.generate()
        self.procs: list[Any] = []
        self.pipes: list[Connection] = []
        self.endpoints: dict[int, str] = {}
        self.leader = ZmqLeader(self.keys)
        self.base = make_decision(0)
        self.next = 0
        self.epoch = 0
        self.n = 0
        for r in range(1, followers + 1):
            a, b = ctx.Pipe()
            p = ctx.Process(target=zmq_follower, args=(r, self.keys, b), daemon=True)
            p.start()
            self.procs.append(p)
            self.pipes.append(a)
        for r, a in enumerate(self.pipes, start=1):
            if not a.poll(60):
                raise TimeoutError(f"zmq follower {r} did not start")
            self.endpoints[r] = a.recv()

    def use(self, n: int) -> None:
        """Fan out to the first ``n`` followers from now on (a new epoch)."""
        self.epoch += 1
        self.n = n
        fol = {r: self.endpoints[r] for r in range(1, n + 1)}
        stream = self.leader.start_epoch(self.epoch, fol)
        for r in fol:
            self.pipes[r - 1].send(("follow", self.epoch, self.leader.server.endpoint))
            self.pipes[r - 1].recv()
        deadline = time.monotonic() + 10
        while not stream.all_synced():
            if time.monotonic() > deadline:
                raise TimeoutError("followers did not sync")
            time.sleep(0.005)

    def latency(self, count: int) -> list[float]:
        """One-way latencies (seconds) of ``count`` paced decisions."""
        stream = self.leader.stream
        assert stream is not None
        first = self.next
        for _ in range(count):
            stream.broadcast(Op.PUT, _relabel(self.base, "L", self.next))
            self.leader.wait_acks(self.next, self.n)
            self.next += 1
        per_follower = []
        for r in range(1, self.n + 1):
            self.pipes[r - 1].send(("lags",))
            per_follower.append(self.pipes[r - 1].recv())
        return [max(p[i] for p in per_follower) for i in range(first, self.next)]

    def throughput(self, count: int) -> float:
        """Decisions per second streamed to the current followers."""
        stream = self.leader.stream
        assert stream is not None
        ds = [_relabel(self.base, "T", self.next + i) for i in range(count)]
        ds[-1] = _relabel(self.base, "END", self.next + count - 1)
        t0 = time.perf_counter()
        for d in ds:
            stream.broadcast(Op.PUT, d)
        self.leader.wait_acks(self.next + count - 1, self.n, timeout=120)
        elapsed = time.perf_counter() - t0
        self.next += count
        return count / elapsed

    def close(self) -> None:
        for a in self.pipes:
            with contextlib.suppress(OSError):
                a.send(("stop",))
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        if self.leader.stream is not None:
            self.leader.stream.close()
        self.leader.server.close()


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


class GlooBench:
    """The baseline: gloo ranks 1..N as processes, rank 0 in this process."""

    def __init__(self, followers: int) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.world = followers + 1
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=gloo_worker, args=(r, self.world, port), daemon=True)
                      for r in range(1, self.world)]
        for p in self.procs:
            p.start()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=self.world)
        self.obj = decision_dict(make_decision(0))
        self.size = torch.zeros(1, dtype=torch.int64)
        self.ack = torch.zeros(1, dtype=torch.float64)

    def _phase(self, n: int, count: int, ack_every: bool) -> None:
        for r in range(1, self.world):
            self.dist.send(self.torch.tensor([n, count, int(ack_every)]), dst=r)

    def _send(self, n: int) -> None:
        self.obj["sent_at"] = time.time()
        data = self.torch.frombuffer(bytearray(pickle.dumps(self.obj)), dtype=self.torch.uint8)
        self.size[0] = data.numel()
        for r in range(1, n + 1):
            self.dist.send(self.size, dst=r)
            self.dist.send(data, dst=r)

    def latency(self, n: int, count: int) -> list[float]:
        self._phase(n, count, True)
        out = []
        for _ in range(count):
            self._send(n)
            worst = 0.0
            for r in range(1, n + 1):
                self.dist.recv(self.ack, src=r)
                worst = max(worst, float(self.ack[0]))
            out.append(worst)
        return out

    def throughput(self, n: int, count: int) -> float:
        self._phase(n, count, False)
        t0 = time.perf_counter()
        for _ in range(count):
            self._send(n)
        for r in range(1, n + 1):
            self.dist.recv(self.ack, src=r)
        return count / (time.perf_counter() - t0)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._phase(0, 0, False)
            self.dist.destroy_process_group()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


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
    ours: dict[str, Any] = {}
    base: dict[str, Any] = {}
    rounds = 4
    zmq_b = ZmqBench(max(counts))
    gloo_b: GlooBench | None = None
    try:
        gloo_b = GlooBench(max(counts))
        # Alternate short batches of both so background load hits both alike.
        for n in counts:
            zmq_b.use(n)
            zmq_b.latency(10)  # warm-up
            gloo_b.latency(n, 10)
            lat_o: list[float] = []
            lat_b: list[float] = []
            for i in range(rounds):
                k = samples // rounds + (1 if i < samples % rounds else 0)
                if k:
                    lat_o += zmq_b.latency(k)
                    lat_b += gloo_b.latency(n, k)
            ours[f"lat{n}"], base[f"lat{n}"] = _stats(lat_o), _stats(lat_b)
            if n == 3:
                per = max(stream_n // rounds, 2)
                tp_o = [zmq_b.throughput(per) for _ in range(rounds)]
                tp_b = [gloo_b.throughput(3, max(per // 10, 2)) for _ in range(rounds)]
                ours["tput3"], base["tput3"] = statistics.median(tp_o), statistics.median(tp_b)
    finally:
        zmq_b.close()
        if gloo_b is not None:
            gloo_b.close()
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

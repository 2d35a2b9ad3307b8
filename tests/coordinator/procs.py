"""Driver for stage processes: start (spawn), call with bounded waits, kill, stop."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
from collections.abc import Iterable
from typing import Any

import numpy as np

from node_agent.pp.auth import CurveKeys
from tests.coordinator.harness import LAYOUT, NUM_SLOTS, group_status, kv_content, stage_main
from tests.support.waiting import wait_for

CALL_TIMEOUT = 20.0
TPB = LAYOUT.tokens_per_block


def _context() -> mp.context.BaseContext:
    """A forkserver that imported the harness (torch included) once: each stage
    starts by a fork of a thread-free process, in a fraction of a second."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([stage_main.__module__])
    return ctx


class StageProc:
    """One stage process and its command pipe."""

    def __init__(self, rank: int, keys: CurveKeys | None, cpu_blocks: int,
                 endpoint: str | None = None) -> None:
        ctx = _context()
        self.rank = rank
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=stage_main,
                                args=(rank, keys, cpu_blocks, child, endpoint),
                                name=f"stage-{rank}", daemon=True)
        self.proc.start()
        child.close()

    def send(self, op: str, **args: Any) -> None:
        self.pipe.send((op, args))

    def recv(self, timeout: float = CALL_TIMEOUT) -> Any:
        if not self.pipe.poll(timeout):
            raise TimeoutError(f"stage {self.rank} did not answer within {timeout}s")
        kind, value = self.pipe.recv()
        if kind == "err":
            raise RuntimeError(f"stage {self.rank}: {value}")
        return value

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **args: Any) -> Any:
        self.send(op, **args)
        return self.recv(timeout)

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(TimeoutError, OSError, EOFError, RuntimeError):
                self.call("stop", timeout=5)
            self.proc.join(3)
        if self.proc.is_alive():
            self.kill()
        self.pipe.close()


class Group:
    """A PP group of stage processes on loopback, driven like engine ranks."""

    def __init__(self, size: int, keys: CurveKeys | None, cpu_blocks: int = 64) -> None:
        self.keys = keys
        self.cpu_blocks = cpu_blocks
        self.stages: dict[int, StageProc] = {}
        self.endpoints: dict[int, str] = {}
        self.epoch = 0
        self.leader = 0
        try:
            for r in range(size):
                self.stages[r] = StageProc(r, keys, cpu_blocks)
            for r, s in self.stages.items():
                self.endpoints[r] = s.call("endpoint", timeout=60)
        except BaseException:
            self.close()
            raise

    def publish_view(self, epoch: int, leader: int, ranks: Iterable[int] | None = None) -> None:
        """Give the view to ``ranks`` (all by default), as the operator's watch would."""
        self.epoch, self.leader = epoch, leader
        status = group_status(epoch, leader, self.endpoints)
        for r in (list(self.stages) if ranks is None else list(ranks)):
            self.stages[r].call("view", status=status)

    def wait_ready(self, timeout: float = 15.0) -> None:
        wait_for(lambda: all(s.call("ready") for s in self.stages.values()),
                 "every stage ready", timeout, interval=0.05)

    def all(self, op: str, ranks: Iterable[int] | None = None, timeout: float = CALL_TIMEOUT,
            **args: Any) -> dict[int, Any]:
        """Issue ``op`` on every stage at once (as PP ranks do) and collect answers."""
        targets = list(self.stages) if ranks is None else list(ranks)
        for r in targets:
            self.stages[r].send(op, **args)
        return {r: self.stages[r].recv(timeout) for r in targets}

    def restart(self, rank: int, kill: bool = False, same_address: bool = False) -> None:
        """Replace a stage by a fresh process: a new endpoint, or the same one
        (``same_address``); ``kill`` ends the old one with SIGKILL."""
        old = self.stages[rank]
        if kill:
            old.kill()
            old.pipe.close()
        else:
            old.stop()
        endpoint = self.endpoints[rank] if same_address else None
        self.stages[rank] = StageProc(rank, self.keys, self.cpu_blocks, endpoint)
        self.endpoints[rank] = self.stages[rank].call("endpoint", timeout=60)

    def close(self) -> None:
        for s in self.stages.values():
            s.stop()


# -- engine calls on every stage at once --------------------------------------------


def random_slots(rng: random.Random, n: int) -> list[int]:
    return rng.sample(range(NUM_SLOTS), n)


def store(g: Group, rid: str, tokens: list[int], rng: random.Random,
          ranks: tuple[int, ...] | None = None) -> dict[int, int]:
    """store_kv on ``ranks`` (every stage by default) at once, each stage with its
    own random slots; the task ids by rank."""
    ranks = tuple(g.stages) if ranks is None else ranks
    for r in ranks:
        g.stages[r].send("store", rid=rid, tokens=tokens, slots=random_slots(rng, len(tokens)))
    return {r: g.stages[r].recv() for r in ranks}


def wait_completed(g: Group, rid: str, ranks: tuple[int, ...] | None = None,
                   timeout: float = 10.0) -> None:
    """Wait until every stage of ``ranks`` (all by default) reported ``rid`` completed."""
    pending = set(g.stages if ranks is None else ranks)

    def reported() -> bool:
        for r in list(pending):
            if rid in g.stages[r].call("poll"):
                pending.discard(r)
        return not pending

    wait_for(reported, f"{rid} completed on stages {sorted(pending)}", timeout)


def load_and_check(g: Group, rid: str, tokens: list[int], rng: random.Random,
                   ranks: tuple[int, ...] | None = None) -> int:
    """lookup + retrieve on ``ranks`` (every stage by default); asserts equal hits
    and bit-exact content; returns the tokens loaded."""
    ranks = tuple(g.stages) if ranks is None else ranks
    hits = g.all("lookup", ranks, rid=rid, tokens=tokens)
    assert len(set(hits.values())) == 1, f"stages disagree on the hit: {hits}"
    hit = hits[ranks[0]]
    assert hit % TPB == 0 and hit <= len(tokens)
    if hit == 0:
        return 0
    dst = {r: random_slots(rng, hit) for r in ranks}
    for r in ranks:
        g.stages[r].send("retrieve", rid=rid, slots=dst[r])
    loaded = {r: g.stages[r].recv() for r in ranks}
    assert len(set(loaded.values())) == 1, f"stages disagree on the load: {loaded}"
    if loaded[ranks[0]]:
        for r in ranks:
            got = g.stages[r].call("read", slots=dst[r])
            np.testing.assert_array_equal(got, kv_content(r, tokens)[:hit],
                                          err_msg=f"stage {r} loaded wrong bytes for {rid}")
    return int(loaded[ranks[0]])

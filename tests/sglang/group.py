"""A two-stage PP replica for the SGLang plugin tests: two real agent processes
(``python -m node_agent run``, embedded backend, group view from a file naming
stage 0 the leader, CurveZMQ fan-out on loopback) and two rank processes
(:mod:`tests.sglang.stage`), one per stage, each talking to its own agent."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from node_agent.pp.auth import CurveKeys
from tests.agent.harness import (
    LAYOUT,
    agent_mapping,
    short_dir,
    start_agent_process,
    stop_process,
    wait_healthy,
    write_group_file,
)
from tests.sglang.stage import layout_json, stage_main

REPLICA = "sgl-0"
NUM_SLOTS = 1024
#: Agent bounds (agent.yaml timeouts) and the rank's client bound above them.
ENGINE_CALL_SECONDS = 4.0
FANOUT_WAIT_SECONDS = 1.5
CLIENT_TIMEOUT = 7.0


class StageRank:
    """One rank process and its command pipe; every wait is bounded."""

    def __init__(self, ctx: Any, sock: str, pp_rank: int, timeouts: dict[str, float]) -> None:
        self.rank = pp_rank
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=stage_main, name=f"sglang-rank-{pp_rank}", daemon=True,
                                args=(sock, REPLICA, pp_rank, 2, layout_json(LAYOUT),
                                      NUM_SLOTS, timeouts, child))
        self.proc.start()
        child.close()

    def send(self, op: str, **args: Any) -> None:
        self.pipe.send((op, args))

    def recv(self, timeout: float) -> Any:
        if not self.pipe.poll(timeout):
            raise AssertionError(f"rank {self.rank} did not answer within {timeout}s (a hang)")
        kind, value, _seconds = self.pipe.recv()
        if kind == "err":
            raise AssertionError(f"rank {self.rank} failed:\n{value}")
        return value

    def call(self, op: str, timeout: float | None = None, **args: Any) -> Any:
        """Send ``op`` and wait for its answer: by default three client bounds, and
        always one client bound more than a wait the op itself is asked to make
        (``within``), so a slow but bounded answer is never taken for a hang."""
        if timeout is None:
            timeout = max(3 * CLIENT_TIMEOUT, float(args.get("within", 0)) + CLIENT_TIMEOUT)
        self.send(op, **args)
        return self.recv(timeout)

    def stop(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.pipe.send(("exit", {}))
        self.proc.join(10)
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(5)


@dataclass
class Replica:
    """Two agents and two ranks; ``both`` sends one command to every rank at once,
    as SGLang's PP schedulers reach the same call in the same scheduler step."""

    work: Path
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    socks: list[str] = field(default_factory=list)
    ranks: list[StageRank] = field(default_factory=list)

    def both(self, op: str, timeout: float | None = None, **args: Any) -> list[Any]:
        if timeout is None:
            timeout = max(3 * CLIENT_TIMEOUT, float(args.get("within", 0)) + CLIENT_TIMEOUT)
        for r in self.ranks:
            r.send(op, **args)
        return [r.recv(timeout) for r in self.ranks]

    def kill_agent(self, stage: int) -> None:
        self.agents[stage].send_signal(signal.SIGKILL)
        self.agents[stage].wait(10)


def _wait_ready(urls: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        with contextlib.suppress(httpx.HTTPError):
            pending = [u for u in pending
                       if httpx.get(f"{u}/readyz", timeout=2.0).status_code != 200]
        if not pending:
            return
        if time.monotonic() > deadline:
            detail = {u: httpx.get(f"{u}/readyz", timeout=2.0).text for u in pending}
            raise AssertionError(f"agents not ready within {timeout}s: {detail}")
        time.sleep(0.1)


@contextlib.contextmanager
def two_stage_replica(retry_seconds: float = 30.0,
                      orphan_store_seconds: float = 60.0) -> Iterator[Replica]:
    """Start the group, register both ranks, wait for both agents' /readyz."""
    work = short_dir("sgl")
    rep = Replica(work)
    try:
        CurveKeys.generate().write(work / "curve")
        cfgs = [agent_mapping(work, f"node-{r}", groupViewFile=str(work / "groups.yaml"),
                              timeouts={"engineCallSeconds": ENGINE_CALL_SECONDS,
                                        "fanoutWaitSeconds": FANOUT_WAIT_SECONDS},
                              tiers={"cpu": {"size": "4Mi", "pinned": False}})
                for r in range(2)]
        write_group_file(work / "groups.yaml", "tp", REPLICA,
                         {r: c["ports"]["fanout"] for r, c in enumerate(cfgs)})
        for r, cfg in enumerate(cfgs):
            path = work / f"agent-{r}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            rep.agents.append(start_agent_process(path, work / f"agent-{r}.log"))
            rep.urls.append(f"http://127.0.0.1:{cfg['ports']['http']}")
            rep.socks.append(str(cfg["engineSocket"]))
        for url, proc in zip(rep.urls, rep.agents, strict=True):
            wait_healthy(url, proc)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.sglang.stage"])
        timeouts = {"client": CLIENT_TIMEOUT, "retry": retry_seconds,
                    "orphan": orphan_store_seconds}
        rep.ranks = [StageRank(ctx, sock, r, timeouts) for r, sock in enumerate(rep.socks)]
        registered = [r.recv(60.0) for r in rep.ranks]
        assert registered == [True, True], registered
        _wait_ready(rep.urls)
        yield rep
    finally:
        for r in rep.ranks:
            r.stop()
        for a in rep.agents:
            stop_process(a)
        shutil.rmtree(work, ignore_errors=True)

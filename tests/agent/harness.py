"""Helpers of the agent tests: agents served by a real uvicorn on loopback inside the
test's event loop, agent subprocesses, configs, and a small KV layout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from node_agent.agent import Agent
from node_agent.assembly import default_stage_builder
from node_agent.client import EngineClient
from node_agent.config import AgentConfig, config_from_mapping
from node_agent.vocab.layout import KVDtype, KVLayout
from tests.support.ports import free_port
from tests.support.waiting import wait_for_async

TPB = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype=KVDtype.FLOAT16,
                  tokens_per_block=TPB)
NUM_SLOTS = 256


def short_dir(tag: str) -> Path:
    """A short directory for ipc sockets (Unix socket paths are limited to 107 bytes)."""
    d = Path(f"/tmp/fkv-{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    d.mkdir(parents=True)
    return d


def agent_mapping(work: Path, node: str, **extra: Any) -> dict[str, Any]:
    """agent.yaml for a test agent on loopback (Kubernetes off)."""
    data: dict[str, Any] = {
        "pool": "tp", "namespace": "ns1", "tokensPerBlock": TPB,
        "tiers": {"cpu": {"size": "1Mi", "pinned": False}},
        "ports": {"http": free_port(), "fanout": free_port()},
        "engineSocket": str(work / f"{node}.sock"),
        "timeouts": {"engineCallSeconds": 5, "fanoutWaitSeconds": 2},
        "heartbeat": {"leaseDurationSeconds": 3, "renewDeadlineSeconds": 2,
                      "retryPeriodSeconds": 0.1},
        "curveKeyDir": str(work / "curve"), "expectedRanks": 1, "nodeName": node,
        "advertiseAddress": "127.0.0.1", "bindAddress": "127.0.0.1", "kubernetes": "off",
    }
    data.update(extra)
    return data


def write_group_file(path: Path, pool: str, replica: str, fanout: dict[int, int],
                     leader: int = 0, epoch: int = 1, unready: tuple[int, ...] = ()) -> None:
    """A KVCacheGroup list file (the shape the operator writes into status)."""
    members = [{"node": f"node-{r}", "ppRank": r, "fanoutEndpoint": f"tcp://127.0.0.1:{p}",
                "ready": r not in unready} for r, p in sorted(fanout.items())]
    group = {"metadata": {"name": f"{pool}-{replica}"},
             "spec": {"poolRef": pool, "replica": replica, "ppSize": len(fanout)},
             "status": {"epoch": epoch, "leader": members[leader], "members": members}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"items": [group]}))
    tmp.replace(path)


@dataclass
class RunningAgent:
    """An in-process agent with its uvicorn server and base URL."""

    agent: Agent
    server: Any
    url: str

    async def get(self, path: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=5.0) as c:
            return await c.get(self.url + path)


@contextlib.asynccontextmanager
async def running_agent(cfg: AgentConfig, kube_api: Any = None,
                        config_path: Path | None = None) -> AsyncIterator[RunningAgent]:
    """Serve an agent on loopback in this event loop; stop it on exit (bounded)."""
    agent = Agent(cfg, default_stage_builder, kube_api=kube_api, config_path=config_path)
    server = agent.uvicorn_server(host="127.0.0.1")
    server.capture_signals = contextlib.nullcontext  # the test process keeps its handlers
    task = asyncio.create_task(server.serve())
    try:
        await wait_for_async(lambda: server.started or task.done(), "uvicorn started", 20)
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped during start-up")
        yield RunningAgent(agent, server, f"http://127.0.0.1:{cfg.ports.http}")
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)


async def wait_stored(client: EngineClient, rid: str, timeout: float = 10.0) -> None:
    """Poll ``client.poll_completed`` (from a worker thread) until it reported
    ``rid``'s store."""
    done: list[str] = []

    async def reported() -> bool:
        done.extend(await asyncio.to_thread(client.poll_completed))
        return rid in done

    await wait_for_async(reported, f"the store of {rid!r} completed", timeout, interval=0.01)


async def wait_http(ra: RunningAgent, path: str, status: int, timeout: float) -> httpx.Response:
    """Poll ``path`` until it answers ``status``; returns that response."""
    deadline = time.monotonic() + timeout
    while True:
        r = await ra.get(path)
        if r.status_code == status:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} answered {r.status_code} {r.text}, wanted {status}")
        await asyncio.sleep(0.1)


def start_agent_process(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """``python -m node_agent run --config`` with its output in ``log``."""
    out = log.open("ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "node_agent", "run", "--config",
                                 str(config)], stdout=out, stderr=subprocess.STDOUT)
    finally:
        out.close()


def stop_process(proc: subprocess.Popen[Any], timeout: float = 20.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout: float = 120.0) -> None:
    """Block until ``url``/healthz answers 200 (fails if the process exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"agent exited with {proc.returncode} before serving")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"agent at {url} not healthy within {timeout}s")


def cfg_of(data: dict[str, Any]) -> AgentConfig:
    return config_from_mapping(data)


@dataclass
class AgentProcess:
    """A running ``python -m node_agent run`` and what a test talks to it by."""

    proc: subprocess.Popen[bytes]
    data: dict[str, Any]
    """Its agent.yaml, as written."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.data['ports']['http']}"

    @property
    def socket(self) -> str:
        return str(self.data["engineSocket"])

    def status(self) -> dict[str, Any]:
        """Its ``/status`` JSON."""
        return dict(httpx.get(self.url + "/status", timeout=5).json())


def launch_agent(work: Path, name: str, data: dict[str, Any]) -> AgentProcess:
    """Write ``data`` to ``work/<name>.yaml``, start an agent process on it with its
    output in ``work/<name>.log`` and return it healthy (stopped again, and the
    error raised, when it never got healthy). The caller stops it."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    agent = AgentProcess(start_agent_process(path, work / f"{name}.log"), data)
    try:
        wait_healthy(agent.url, agent.proc)
    except BaseException:
        stop_process(agent.proc)
        raise
    return agent


@contextlib.contextmanager
def agent_process(work: Path, node: str = "solo", **extra: Any) -> Iterator[AgentProcess]:
    """An agent process of :func:`agent_mapping` (``extra`` overrides its keys), its
    config in ``work/agent.yaml`` and its output in ``work/agent.log``, healthy;
    stopped on exit (``work`` is the caller's to remove)."""
    agent = launch_agent(work, "agent", agent_mapping(work, node, **extra))
    try:
        yield agent
    finally:
        stop_process(agent.proc)


@contextlib.contextmanager
def agent_starter(work: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Yields ``start(node, data=None, **extra)``: an agent process named ``node``
    (``data``, or :func:`agent_mapping` with ``extra`` overriding its keys, in
    ``work/<node>.yaml``; its output in ``work/<node>.log``), healthy. Every agent
    it started is stopped on exit."""
    started: list[AgentProcess] = []

    def start(node: str, data: dict[str, Any] | None = None, **extra: Any) -> AgentProcess:
        agent = launch_agent(work, node, data if data is not None
                             else agent_mapping(work, node, **extra))
        started.append(agent)
        return agent

    try:
        yield start
    finally:
        for agent in started:
            stop_process(agent.proc)

"""The workload the dashboard is proven on: real processes a Prometheus scrapes.

* a real ``mooncake_master`` (the remote tier);
* two real agent processes (``python -m node_agent run``), one PP group of two
  stages with a small CPU tier (it evicts) over the remote tier, their group view
  from a file as the operator would publish it;
* demo engine ranks (``python -m node_agent.demo.engine``, the client library)
  replaying multi-turn conversations, one per stage;
* the real operator against the emulated API server (kmock) with its metrics
  endpoint served as in production, its metrics populated by real reconciles, an
  API error and a group failover (agents' heartbeat Leases written over HTTP).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import yaml

from node_agent.demo.workload import WorkloadSpec
from node_agent.engine_api.protocol import layout_to_wire
from node_agent.pp.auth import CurveKeys
from tests.agent.harness import (
    LAYOUT,
    agent_mapping,
    start_agent_process,
    stop_process,
    wait_healthy,
    write_group_file,
)
from tests.remote.master import Master, store_port
from tests.support.ports import free_port
from tests.support.waiting import wait_for

POOL = "tp"
NAMESPACE = "ns1"
REPLICA = "rep"
GROUP = f"{POOL}-{REPLICA}"
ENGINE_TIMEOUT_S = 120.0


class AgentGroup:
    """Two agent processes forming one PP group over a real remote tier."""

    def __init__(self, work: Path, master: Master) -> None:
        self.work = work
        self.group_file = work / "groups.yaml"
        CurveKeys.generate().write(work / "curve")
        self.maps = []
        for r in range(2):
            self.maps.append(agent_mapping(
                work, f"node-{r}", pool=POOL, namespace=NAMESPACE,
                groupViewFile=str(self.group_file),
                tiers={
                    # 48 blocks of the test layout: the workload evicts from it.
                    "cpu": {"size": "24Ki", "pinned": False},
                    "remote": {"timeoutSeconds": 2, "queueBlocks": 256, "mooncake": {
                        "masterAddress": master.address,
                        "metadataServer": master.metadata,
                        "segmentSize": "16Mi", "localBufferSize": "1Mi",
                        "storePort": store_port()}},
                }))
        self.fanout = {r: m["ports"]["fanout"] for r, m in enumerate(self.maps)}
        self.urls = [f"http://127.0.0.1:{m['ports']['http']}" for m in self.maps]
        self.procs: list[subprocess.Popen[bytes]] = []

    def publish(self, leader: int, epoch: int) -> None:
        """Write the group view (as the operator publishes it in KVCacheGroup status)."""
        write_group_file(self.group_file, POOL, REPLICA, self.fanout, leader=leader, epoch=epoch)

    def launch(self) -> None:
        """Start both agent processes (stage 0 leads at epoch 1); returns at once."""
        self.publish(leader=0, epoch=1)
        for r, data in enumerate(self.maps):
            path = self.work / f"agent-{r}.yaml"
            path.write_text(yaml.safe_dump(data))
            self.procs.append(start_agent_process(path, self.work / f"agent-{r}.log"))

    def wait_started(self) -> None:
        """Wait (bounded) until both agents serve and joined the remote tier."""
        for url, proc in zip(self.urls, self.procs, strict=True):
            wait_healthy(url, proc, timeout=90)
        for url in self.urls:
            wait_for(lambda url=url: self.status(url)["remoteTier"]["up"] is True,
                     f"{url} joined the remote tier", 90, interval=0.1,
                     ignoring=(httpx.HTTPError,))

    def status(self, url: str) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(url + "/status", timeout=5).json()
        return body

    def roles(self) -> list[tuple[str, int]]:
        """(role, epoch) of each agent's stage."""
        out = []
        for url in self.urls:
            stages = self.status(url)["stages"]
            out.append((stages[0]["role"], stages[0]["epoch"]) if stages else ("none", -1))
        return out

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)


def run_engines(work: Path, group: AgentGroup, spec: WorkloadSpec, tag: str,
                before_go: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """One demo engine rank per stage replaying ``spec``; returns their results.
    ``before_go`` runs once every engine registered, before the workload starts."""
    engines = []
    log = (work / f"engines-{tag}.log").open("w")
    try:
        for r, data in enumerate(group.maps):
            cmd = [sys.executable, "-m", "node_agent.demo.engine",
                   "--socket", str(data["engineSocket"]), "--replica", REPLICA,
                   "--pp-rank", str(r), "--pp-size", "2",
                   "--layout", json.dumps(layout_to_wire(LAYOUT)),
                   "--num-slots", str(spec.max_tokens * 2), "--workload", json.dumps(asdict(spec)),
                   "--timeout", "20"]
            engines.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, text=True))
        return _drive(engines, group.urls, before_go)
    finally:
        for e in engines:
            if e.poll() is None:
                e.kill()
            e.wait(timeout=10)
        log.close()


def _drive(engines: list[subprocess.Popen[str]], urls: list[str],
           before_go: Callable[[], None] | None) -> list[dict[str, Any]]:
    import selectors

    for e in engines:
        assert e.stdout is not None
        with selectors.DefaultSelector() as one:
            one.register(e.stdout, selectors.EVENT_READ)
            assert one.select(timeout=ENGINE_TIMEOUT_S), "engine did not register in time"
        line = e.stdout.readline()
        assert line and "registered" in json.loads(line), f"engine did not register: {line!r}"
    if before_go is not None:
        before_go()
    for url in urls:
        wait_for(lambda url=url: httpx.get(url + "/readyz", timeout=5).status_code == 200,
                 f"{url} ready", 60, interval=0.1,
                 ignoring=(httpx.HTTPError,))
    for e in engines:
        assert e.stdin is not None
        e.stdin.write("go\n")
        e.stdin.flush()
    sel = selectors.DefaultSelector()
    for i, e in enumerate(engines):
        assert e.stdout is not None
        sel.register(e.stdout, selectors.EVENT_READ, i)
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    open_streams = len(engines)
    while open_streams:
        assert time.monotonic() < deadline, f"engines did not finish in {ENGINE_TIMEOUT_S}s"
        for key, _ in sel.select(timeout=0.5):
            line = key.fileobj.readline()  # type: ignore[union-attr]
            if not line:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            msg = json.loads(line)
            assert "error" not in msg, f"engine {key.data} failed: {msg['error']}"
            if "result" in msg:
                results[key.data] = msg["result"]
    assert sorted(results) == list(range(len(engines))), results
    return [results[i] for i in sorted(results)]


class OperatorScene:
    """The real operator (kopf) against kmock in a thread of its own, metrics on a port.

    ``start`` returns once a pool's PP group has a leader; ``fail_over`` stops the
    leader's heartbeats and returns once the operator published its successor."""

    def __init__(self, metrics_port: int) -> None:
        self.metrics_port = metrics_port
        self._elected = threading.Event()
        self._go = threading.Event()
        self._failed_over = threading.Event()
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="operator-scene", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._wait(self._elected, 90, "a group leader elected by the operator")

    def fail_over(self) -> None:
        self._go.set()
        self._wait(self._failed_over, 90, "the operator's failover")

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "operator scene did not stop within 60s"

    def _wait(self, event: threading.Event, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not event.wait(0.1):
            if self._errors:
                raise AssertionError(f"operator scene failed before {what}") from self._errors[0]
            assert time.monotonic() < deadline, f"{what} not seen within {timeout}s"

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # handed to the waiting test
            self._errors.append(exc)

    async def _main(self) -> None:
        from tests.operator.flexkv_harness import (  # the operator tests' harness
            FAST,
            FakeAgent,
            heartbeating,
            pool_manifest,
            running_operator,
        )
        from tests.support.kube_api import GROUPS, NS, POOLS, api_server
        from tests.support.waiting import wait_for_async

        async with api_server() as api:
            # One refused create: an API error the operator retries and counts.
            api.fail(422, action="create", plural="configmaps", times=1)
            agents = [FakeAgent(api, "pool", node, [{"replica": "r0", "ppRank": rank,
                                                    "ppSize": 2}])
                      for rank, node in enumerate(["node-a", "node-b"])]
            for agent in agents:
                await agent.start()
            async with (heartbeating(agents, 0.25) as alive,
                        running_operator(api, metrics_port=self.metrics_port,
                                         startup_timeout=60)):
                await api.create_object(POOLS, pool_manifest(**FAST))

                def leader() -> str | None:
                    status = (api.stored(GROUPS, NS, "pool-r0") or {}).get("status") or {}
                    node: str | None = (status.get("leader") or {}).get("node")
                    return node

                await wait_for_async(lambda: leader() == "node-a", "leader node-a", 60)
                self._elected.set()
                await asyncio.to_thread(self._go.wait, 600)
                if self._stop.is_set():
                    return
                alive["node-a"] = False
                await wait_for_async(lambda: leader() == "node-b", "failover to node-b", 60)
                self._failed_over.set()
                await asyncio.to_thread(self._stop.wait, 600)


__all__ = ["AgentGroup", "Master", "OperatorScene", "free_port", "run_engines"]

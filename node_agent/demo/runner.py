"""``flexkv-agent demo``: a PP group of agents on this machine, driven by synthetic
engine ranks, with single-stage replicas of one model on the same agents, ending
with a results table.

What it starts (all real processes, loopback sockets only):

* one agent per PP stage (``python -m node_agent run``), embedded backend,
  Kubernetes off, group view from a shared file naming stage 0 the leader, and
  ``maxStages`` room for the replicas it also serves;
* one engine rank per stage (:mod:`node_agent.demo.engine`), each registering
  shared-memory KV buffers with its agent and replaying the same workload;
* per agent, one engine process running that node's single-stage replicas of one
  model (``--replicas`` on node-0, ``--other-replicas`` on each other node), which
  serve another workload between them, routed round robin by turn (each turn's
  prefix was stored by another replica of the node).

While it runs it prints the agents' /status and /metrics URLs and a progress bar;
at the end it reads node-0's /metrics for transfer bandwidth (every stage of that
agent: the PP leader and the replicas) and prints the table: the PP group's hit
rate, the bandwidth, and per node the replicas' hit rate
and cross-replica hits (hit tokens beyond the longest prefix the replica stored
itself, so stored by another replica; counted by the engines from their own
lookups). Every agent and engine is stopped (SIGTERM, then SIGKILL after a bound)
whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import yaml

from node_agent.contract import kube

if TYPE_CHECKING:
    from node_agent.demo.workload import WorkloadSpec
    from node_agent.vocab.layout import KVLayout


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a count >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1; give a count >= 1")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give a count >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is below 0; give a count >= 0")
    return value


REPLICA_MODEL = "demo-llm"
"""The model the single-stage replicas send (its digest); the PP group sends none."""


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options (defaults finish in well under a minute on 2 cores)."""
    p.add_argument("--stages", type=_positive, default=2, help="PP stages (agents), default 2")
    p.add_argument("--replicas", type=_count, default=4,
                   help="single-stage replicas of one model on node-0's agent, default 4")
    p.add_argument("--other-replicas", type=_count, default=1,
                   help="single-stage replicas on each other agent, default 1")
    p.add_argument("--conversations", type=_positive, default=12, help="default 12")
    p.add_argument("--turns", type=_positive, default=4, help="turns per conversation, default 4")
    p.add_argument("--shared-prefixes", type=_positive, default=2,
                   help="distinct system prompts the conversations share, default 2")
    p.add_argument("--system-tokens", type=_positive, default=512, help="default 512")
    p.add_argument("--user-tokens", type=_positive, default=96, help="per turn, default 96")
    p.add_argument("--reply-tokens", type=_positive, default=64, help="per turn, default 64")
    p.add_argument("--layers", type=_positive, default=8, help="layers per PP stage, default 8")
    p.add_argument("--kv-heads", type=_positive, default=4, help="default 4")
    p.add_argument("--head-size", type=_positive, default=64, help="default 64")
    p.add_argument("--tokens-per-block", type=_positive, default=16, help="default 16")
    p.add_argument("--cpu-size", default="640Mi",
                   help="CPU tier size per agent, split among the stages it serves "
                   "(maxStages), default 640Mi")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="bound on the whole run, seconds, default 120")
    p.add_argument("--keep", action="store_true", help="keep the work directory")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bar(done: int, total: int, width: int = 32) -> str:
    filled = int(width * done / max(total, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


class _Procs:
    """Started processes, stopped in reverse order with bounded waits."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []

    def start(self, name: str, args: list[str], log: IO[str] | None,
              pipes: bool = False) -> subprocess.Popen[str]:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE if pipes else log,
                                stdin=subprocess.PIPE if pipes else None,
                                stderr=log, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.procs.append((name, proc))
        return proc

    def stop(self, grace: float = 10.0) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name, proc in reversed(self.procs):
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait(timeout=5)
        return codes


def _metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in (labels or {}).items()):
            total += float(m.group(3))
    return total


def _http_get(url: str, timeout: float) -> tuple[int, str]:
    """GET ``url`` with the standard library: (status, body); OSError when unreachable.

    The demo ships with the ``agent`` extra, so it uses no HTTP client package.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _wait_healthy(url: str, proc: subprocess.Popen[str], deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agent behind {url} exited with code {proc.returncode}")
        with contextlib.suppress(OSError):
            if _http_get(f"{url}/healthz", timeout=1.0)[0] == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"agent at {url} did not answer /healthz in time")


def _write_group_file(path: Path, pool: str, replica: str, fanout_ports: list[int]) -> None:
    members = [{"node": f"node-{r}", "ppRank": r, "fanoutEndpoint": f"tcp://127.0.0.1:{port}",
                "ready": True} for r, port in enumerate(fanout_ports)]
    group = {"apiVersion": kube.API_VERSION, "kind": kube.GROUP_KIND,
             "metadata": {"name": kube.group_name(pool, replica)},
             "spec": {"poolRef": pool, "replica": replica, "ppSize": len(fanout_ports)},
             "status": {"epoch": 1, "leader": members[0], "members": members,
                        "phase": "Ready"}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"items": [group]}))
    tmp.replace(path)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every request was served and every loaded token matched."""
    from node_agent.demo.workload import WorkloadSpec
    from node_agent.engine_api.protocol import layout_to_wire
    from node_agent.pp.auth import CurveKeys
    from node_agent.vocab.layout import KVDtype, KVLayout

    spec = WorkloadSpec(conversations=args.conversations, turns=args.turns,
                        shared_prefixes=args.shared_prefixes, system_tokens=args.system_tokens,
                        user_tokens=args.user_tokens, reply_tokens=args.reply_tokens)
    layout = KVLayout(num_layers=args.layers, num_kv_heads=args.kv_heads,
                      head_size=args.head_size, dtype=KVDtype.FLOAT16,
                      tokens_per_block=args.tokens_per_block)
    work = Path(tempfile.mkdtemp(prefix="fkv-demo-"))
    deadline = time.monotonic() + args.timeout
    procs = _Procs()
    pool, replica = "demo", "demo-0"
    replicas = [args.replicas] + [args.other_replicas] * (args.stages - 1)  # per node
    replica_spec = WorkloadSpec(**{**asdict(spec), "seed": spec.seed + 1})
    log = (work / "agents.log").open("w")
    try:
        CurveKeys.generate().write(work / "curve")
        http_ports = [_free_port() for _ in range(args.stages)]
        fanout_ports = [_free_port() for _ in range(args.stages)]
        _write_group_file(work / "groups.yaml", pool, replica, fanout_ports)
        urls = []
        for r in range(args.stages):
            cfg = {"pool": pool, "namespace": "default", "backend": "embedded",
                   "tokensPerBlock": args.tokens_per_block,
                   "tiers": {"cpu": {"size": args.cpu_size, "pinned": False}},
                   "ports": {"http": http_ports[r], "fanout": fanout_ports[r]},
                   "engineSocket": str(work / f"engine-{r}.sock"),
                   "timeouts": {"engineCallSeconds": 10, "fanoutWaitSeconds": 5},
                   "curveKeyDir": str(work / "curve"), "expectedRanks": 1,
                   "maxStages": 1 + replicas[r],
                   "nodeName": f"node-{r}", "advertiseAddress": "127.0.0.1",
                   "bindAddress": "127.0.0.1", "kubernetes": "off",
                   "groupViewFile": str(work / "groups.yaml")}
            path = work / f"agent-{r}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            procs.start(f"agent-{r}", [sys.executable, "-m", "node_agent", "run",
                                       "--config", str(path)], log)
            urls.append(f"http://127.0.0.1:{http_ports[r]}")
        for (_, proc), url in zip(procs.procs, urls, strict=True):
            _wait_healthy(url, proc, deadline)
        print(f"flexkv demo: {args.stages} agents (one PP group of {args.stages} stages; "
              f"{sum(replicas)} single-stage replicas of one model), "
              f"{spec.requests} requests per workload, work dir {work}")
        for r, url in enumerate(urls):
            role = "leader" if r == 0 else "follower"
            serves = f"{replicas[r]} replica{'' if replicas[r] == 1 else 's'}"
            print(f"  node-{r}: PP stage {r} ({role}) + {serves}: "
                  f"{url}/status  {url}/metrics")
        engines = []
        num_slots = spec.max_tokens * 2
        for r in range(args.stages):
            cmd = [sys.executable, "-m", "node_agent.demo.engine",
                   "--socket", str(work / f"engine-{r}.sock"), "--replica", replica,
                   "--pp-rank", str(r), "--pp-size", str(args.stages),
                   "--layout", json.dumps(layout_to_wire(layout)),
                   "--num-slots", str(num_slots), "--workload", json.dumps(asdict(spec)),
                   "--timeout", "20"]
            engines.append(procs.start(f"engine-{r}", cmd, log, pipes=True))
        nodes = [r for r in range(args.stages) if replicas[r]]  # engine stages + i: node i
        for r in nodes:
            cmd = [sys.executable, "-m", "node_agent.demo.engine",
                   "--socket", str(work / f"engine-{r}.sock"), "--replica", f"rep-n{r}",
                   "--replicas", str(replicas[r]), "--model", REPLICA_MODEL,
                   "--layout", json.dumps(layout_to_wire(layout)),
                   "--num-slots", str(num_slots), "--workload", json.dumps(asdict(replica_spec)),
                   "--timeout", "20"]
            engines.append(procs.start(f"replicas-{r}", cmd, log, pipes=True))
        _start_when_ready(engines, urls, deadline)
        results = _follow(engines, spec.requests, deadline)
        pp = [res for i, res in results if i < args.stages]
        by_node = {r: [res for i, res in results if i >= args.stages
                       and nodes[i - args.stages] == r] for r in nodes}
        metrics = _http_get(f"{urls[0]}/metrics", timeout=5)[1]
        _print_table(pp, metrics, layout, spec)
        _print_replicas(by_node, replicas)
        ok = (len(pp) == args.stages
              and all(r["requests"] == spec.requests for r in pp)
              and all(len(got) == replicas[r]
                      and sum(x["requests"] for x in got) == replica_spec.requests
                      for r, got in by_node.items())
              and all(res["mismatched_tokens"] == 0 for _, res in results))
        return 0 if ok else 1
    finally:
        codes = procs.stop()
        log.close()
        bad = {k: v for k, v in codes.items() if k.startswith("agent") and v not in (0, None)}
        if bad:
            print(f"agents exited with {bad}; log: {work / 'agents.log'}")
        if not args.keep and not bad:
            shutil.rmtree(work, ignore_errors=True)


def _start_when_ready(engines: list[subprocess.Popen[str]], urls: list[str],
                      deadline: float) -> None:
    """Wait for every engine to register and every agent to be ready, then say go."""
    for e in engines:
        assert e.stdout is not None
        line = e.stdout.readline()  # bounded: the engine's own calls time out
        if not line or "registered" not in json.loads(line):
            raise RuntimeError(f"engine did not register: {line.strip() or 'it exited'}")
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            pending = [u for u in pending if _http_get(f"{u}/readyz", timeout=2.0)[0] != 200]
        if pending:
            time.sleep(0.1)
    if pending:
        raise TimeoutError(f"agents {pending} did not become ready; see /readyz there")
    for e in engines:
        assert e.stdin is not None
        e.stdin.write("go\n")
        e.stdin.flush()
    print("  all agents ready; running the workload")


def _follow(engines: list[subprocess.Popen[str]], total: int,
            deadline: float) -> list[tuple[int, dict[str, Any]]]:
    """Show engine 0's progress; collect every engine's result lines (an engine
    process of several replicas writes one per replica) as (engine, result)."""
    import selectors

    sel = selectors.DefaultSelector()
    for i, e in enumerate(engines):
        assert e.stdout is not None
        sel.register(e.stdout, selectors.EVENT_READ, i)
    results: list[tuple[int, dict[str, Any]]] = []
    tty = sys.stdout.isatty()
    open_streams = len(engines)
    while open_streams and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            line = key.fileobj.readline()  # type: ignore[union-attr]
            if not line:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            msg = json.loads(line)
            if "progress" in msg and key.data == 0:
                done = msg["progress"]
                if tty:
                    print("\r  " + _bar(done, total), end="", flush=True)
                elif done == total or done % max(1, total // 4) == 0:
                    print("  " + _bar(done, total), flush=True)
            elif "result" in msg:
                results.append((key.data, msg["result"]))
            elif "error" in msg:
                print(f"\n  engine {key.data} failed: {msg['error']}")
    if tty:
        print()
    if open_streams:
        print("  demo timed out; raise --timeout or shrink the workload")
    return sorted(results, key=lambda item: (item[0], str(item[1].get("replica", ""))))


def _print_table(results: list[dict[str, Any]], metrics: str, layout: KVLayout,
                 spec: WorkloadSpec) -> None:
    if not results:
        print("no engine finished; see the agents' log")
        return
    lead = results[0]
    hit_rate = lead["hit_tokens"] / max(lead["prompt_tokens"], 1)
    store_b = _metric(metrics, "flexkv_agent_transfer_bytes_total", {"direction": "store"})
    load_b = _metric(metrics, "flexkv_agent_transfer_bytes_total", {"direction": "load"})
    store_s = _metric(metrics, "flexkv_agent_transfer_seconds_sum", {"direction": "store"})
    load_s = _metric(metrics, "flexkv_agent_transfer_seconds_sum", {"direction": "load"})
    rows = [
        ("requests", f"{lead['requests']} on each of {len(results)} stages"),
        ("hit rate (prompt tokens)", f"{hit_rate:.1%}"),
        ("prefill tokens saved", f"{lead['loaded_tokens']} of {lead['prompt_tokens']}"),
        ("loaded tokens verified", "all bit-exact" if all(
            r["mismatched_tokens"] == 0 for r in results) else
         f"{sum(r['mismatched_tokens'] for r in results)} MISMATCHED"),
        ("store bandwidth (node-0)", f"{store_b / store_s / 1e9:.2f} GB/s" if store_s else "n/a"),
        ("load bandwidth (node-0)", f"{load_b / load_s / 1e9:.2f} GB/s" if load_s else "n/a"),
        ("KV bytes per token per stage", f"{layout.bytes_per_token}"),
        ("wall time (stage 0)", f"{lead['wall_seconds']:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nResults")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print(f"\n  {'call':<12}{'stage':>6}{'p50 ms':>10}{'p99 ms':>10}{'count':>8}")
    for r in results:
        for op, lat in r["latency"].items():
            print(f"  {op:<12}{r['rank']:>6}{lat['p50_ms']:>10.3f}{lat['p99_ms']:>10.3f}"
                  f"{lat['count']:>8}")


def _print_replicas(by_node: dict[int, list[dict[str, Any]]], replicas: list[int]) -> None:
    """Per node: its replicas' requests, hit rate and cross-replica hits (hit tokens a
    replica got beyond what it stored itself: prompts another replica stored)."""
    if not by_node:
        return
    print("\nSingle-stage replicas of one model, per node (one workload per node, "
          "routed round robin by turn)")
    print(f"  {'node':<8}{'replicas':>9}{'requests':>10}{'hit rate':>10}"
          f"{'cross-replica hits':>26}{'verified':>14}")
    for r, got in sorted(by_node.items()):
        prompt = sum(x["prompt_tokens"] for x in got)
        hit = sum(x["hit_tokens"] for x in got)
        cross = sum(x["cross_hit_tokens"] for x in got)
        cross_req = sum(x["cross_hit_requests"] for x in got)
        bad = sum(x["mismatched_tokens"] for x in got)
        requests = sum(x["requests"] for x in got)
        cross_text = f"{cross} tok in {cross_req} req"
        print(f"  {'node-' + str(r):<8}{len(got):>5}/{replicas[r]:<3}{requests:>10}"
              f"{hit / max(prompt, 1):>10.1%}{cross_text:>26}"
              f"{'bit-exact' if bad == 0 else str(bad) + ' BAD':>14}")

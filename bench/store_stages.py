"""Where a store through the engine socket spends its time, stage by stage.

Starts an agent (embedded backend, one stage) through this script, which wraps
a few of the agent's functions to record ``time.perf_counter()`` on their entry
and exit (one clock for the engine and the agent process on Linux), acts as
its engine over :class:`node_agent.client.EngineClient` (shared-memory KV
filled with random values, like ``bench/engine_api.py``), runs ``--rounds``
stores of ``--tokens`` tokens and waits for each with ``wait_completed``, and
prints one JSON object: the median time from the engine sending ``store_kv``
to each stage (ms), and the median total. A profiling aid for docs/agent.md
("The store path, stage by stage"), not a benchmark with a baseline.

    python bench/store_stages.py [--rounds 30] [--tokens 2048] [--layers 8] [--evict]

``--evict`` copies 64 MiB in the engine before each store, so the agent's work
runs as cache-cold as between the rounds of ``bench/engine_api.py``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STAGES = ("service.store_kv>", "put_match>", "put_match<", "launch>", "launch<",
          "copy>", "copy<", "finish_put>", "finish_put<", "wait_completed.got")


def _agent(argv: list[str]) -> int:
    """The agent process: wrap the store path's stages, then run the agent."""
    from node_agent.__main__ import main
    from node_agent.backend import embedded, transfer
    from node_agent.coordinator import leader, tracking
    from node_agent.engine_api import service

    marks: list[tuple[float, str]] = []
    lock = threading.Lock()

    def mark(tag: str) -> None:
        with lock:
            marks.append((time.perf_counter(), tag))

    def wrap(owner: Any, name: str, tag: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            mark(tag + ">")
            try:
                return fn(*args, **kwargs)
            finally:
                mark(tag + "<")

        setattr(owner, name, timed)

    wrap(embedded.EmbeddedBackend, "put_match", "put_match")
    wrap(embedded.EmbeddedBackend, "launch", "launch")
    wrap(transfer.BlockCopier, "store", "copy")
    finish = leader.LeaderRole._finish_put

    def finishing(self: Any, *args: Any, **kwargs: Any) -> Any:
        mark("finish_put>")
        return finish(self, *args, **kwargs)

    leader.LeaderRole._finish_put = finishing  # type: ignore[method-assign]
    queue = tracking.CompletedRids.add

    def queued(self: Any, rids: Any) -> None:
        # "finish_put<" is the rid being queued, before the engine can be told:
        # a mark after _finish_put returns may land after the engine's answer.
        rids = list(rids)
        if rids:
            mark("finish_put<")
        queue(self, rids)

    tracking.CompletedRids.add = queued  # type: ignore[method-assign]
    call = service.EngineService.__call__

    def serve(self: Any, req: Any) -> Any:
        mark(f"service.{req.op}>")
        return call(self, req)

    service.EngineService.__call__ = serve  # type: ignore[method-assign]
    wait = service.wait_completed

    def waited(conn: Any, timeout_ms: int) -> list[str]:
        out = wait(conn, timeout_ms)
        if out:
            mark("wait_completed.got")
        return out

    service.wait_completed = waited
    park = service.EngineService.park

    def parked(self: Any, req: Any) -> Any:
        # A single-stage group's wait_completed is parked on the I/O thread:
        # mark when its poll takes the rid, as ``waited`` does for a worker's wait.
        p = park(self, req)
        if p is not None:
            poll = p.poll

            def marked() -> Any:
                out = poll()
                if out:
                    mark("wait_completed.got")
                return out

            p.poll = marked
        return p

    service.EngineService.park = parked  # type: ignore[method-assign]

    def dump() -> None:
        Path(os.environ["FLEXKV_STAGES_OUT"]).write_text(json.dumps(marks))

    atexit.register(dump)
    return main(argv)


def _engine(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import yaml

    from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
    from node_agent.vocab.layout import KVDtype, KVLayout

    layout = KVLayout(num_layers=args.layers, num_kv_heads=8, head_size=128,
                      dtype=KVDtype.FLOAT16, tokens_per_block=16)
    n = args.tokens
    work = Path(tempfile.mkdtemp(prefix="fkv-stages-"))
    sock = str(work / "engine.sock")
    cfg = {"pool": "stages", "tokensPerBlock": 16, "engineSocket": sock,
           "tiers": {"cpu": {"size": (args.rounds + 4) * n * layout.bytes_per_token,
                             "pinned": False}},
           "ports": {"http": 0, "fanout": 0}, "nodeName": "stages",
           "bindAddress": "127.0.0.1", "kubernetes": "off",
           "timeouts": {"engineCallSeconds": 30}}
    (work / "agent.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, FLEXKV_STAGES_OUT=str(work / "marks.json"))
    log = (work / "agent.log").open("wb")
    proc = subprocess.Popen([sys.executable, __file__, "--agent-wrapper", "run", "--config",
                             str(work / "agent.yaml")], stdout=log, stderr=log, env=env)
    bufs = SharedKVBuffers.for_layout(layout, 2 * n)
    sent: list[tuple[float, float]] = []
    try:
        deadline = time.monotonic() + 60
        while not Path(sock).exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the agent did not start; see {work / 'agent.log'}")
            time.sleep(0.1)
        client = EngineClient(sock, RankInfo("stages-0"), timeout=45)  # above the call bound
        client.register_kv_buffers(layout, bufs.handles)
        for group in bufs.tensors:
            for t in group:
                t.copy_(torch.randn(t.shape).to(t.dtype))
        rng = np.random.default_rng(0)
        src = np.arange(n, dtype=np.int64)
        # --evict: 64 MiB copied in the engine before each store (numpy: no OpenMP
        # workers left spinning into the timed store), as bench/engine_api.py's
        # baseline copies and checks leave the caches before its stores.
        evict = (np.ones(64 << 20, dtype=np.uint8), np.empty(64 << 20, dtype=np.uint8)) \
            if args.evict else None
        for r in range(args.rounds):
            ids = rng.integers(0, 1 << 30, n, dtype=np.int64)
            if evict is not None:
                np.copyto(evict[1], evict[0])
            t0 = time.perf_counter()
            client.store_kv(f"s{r}", ids, src)
            while f"s{r}" not in client.wait_completed(1.0):
                pass
            sent.append((t0, time.perf_counter()))
            client.release(f"s{r}")
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)
        bufs.close()
    marks = json.loads((work / "marks.json").read_text())
    shutil.rmtree(work, ignore_errors=True)
    since: dict[str, list[float]] = {k: [] for k in (*STAGES, "total")}
    for t0, t1 in sent:
        first: dict[str, float] = {}
        for t, tag in marks:
            if t0 <= t <= t1:
                first.setdefault(tag, t)
        for k in STAGES:
            if k in first:
                since[k].append((first[k] - t0) * 1e3)
        since["total"].append((t1 - t0) * 1e3)
    print(json.dumps({
        "bench": "store_stages", "tokens": n, "layers": args.layers, "rounds": args.rounds,
        "ms_since_store_kv_sent": {k: round(statistics.median(v), 3)
                                   for k, v in since.items() if v},
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }), flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--agent-wrapper":
        return _agent(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--evict", action="store_true",
                   help="copy 64 MiB in the engine before each store (as bench/engine_api.py's "
                        "baseline copies leave the caches)")
    _engine(p.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())

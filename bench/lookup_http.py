"""``POST /v1/lookup`` benchmark: what a KV-aware router pays to ask an agent how much of
a 32K-token prompt it holds, against a baseline measured in the same run.

An agent runs as its own process (``python -m node_agent run``, embedded backend,
one stage holding the whole prompt on its CPU tier); this process registers
shared-memory KV buffers through :class:`node_agent.client.EngineClient`, stores
the prompt, then alternates, over one keep-alive HTTP connection,

* ``lookup``: ``POST /v1/lookup`` of the 32K token ids, a full hit; once as JSON
  (about 190 KB) and once as little-endian int64 (``application/octet-stream``,
  256 KB, no parsing);
* ``healthz``: ``GET /healthz`` (the baseline: an HTTP round trip to the same
  server doing almost nothing).

It prints p50/p99 of each and ``ratio`` = lookup / healthz (the lookup's cost in
plain round trips; lower is better). A last row times the agent's own work for
the same request in this process, without HTTP: checking an int64 body and
``EmbeddedBackend.peek`` of the prompt in a 32K-token index; its baseline is
hashing the prompt alone.

    python -P bench/lookup_http.py            # default run (about 20 s on 2 cores)
    python -P bench/lookup_http.py --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.engine_api import start_agent, wait_stored
from bench.match import fill
from node_agent.backend.hashing import BlockHasher
from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.http.lookup import parse_lookup_binary
from node_agent.vocab.layout import KVDtype, KVLayout


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def measure(http: httpx.Client, tokens: int, samples: int, binary: bool) -> dict[str, Any]:
    """Alternate lookup and healthz ``samples`` times each; their latencies in ms."""
    prompt = list(range(1, tokens + 1))
    if binary:
        body = np.asarray(prompt, dtype="<i8").tobytes()
        headers = {"content-type": "application/octet-stream"}
    else:
        body = json.dumps({"tokenIds": prompt}).encode()
        headers = {"content-type": "application/json"}
    first = http.post("/v1/lookup", content=body, headers=headers)
    first.raise_for_status()
    hit = first.json()["cachedTokens"]
    if hit != tokens:
        raise RuntimeError(f"the prompt is not fully cached: {first.json()}")
    ours: list[float] = []
    base: list[float] = []
    for _ in range(samples):
        t0 = time.perf_counter()
        r = http.post("/v1/lookup", content=body, headers=headers)
        ours.append((time.perf_counter() - t0) * 1e3)
        assert r.status_code == 200
        t0 = time.perf_counter()
        r = http.get("/healthz")
        base.append((time.perf_counter() - t0) * 1e3)
        assert r.status_code == 200
    return {"lookup_p50_ms": round(pct(ours, 50), 3), "lookup_p99_ms": round(pct(ours, 99), 3),
            "healthz_p50_ms": round(pct(base, 50), 3), "healthz_p99_ms": round(pct(base, 99), 3),
            "ratio_p50": round(pct(ours, 50) / pct(base, 50), 2),
            "ratio_p99": round(pct(ours, 99) / pct(base, 99), 2), "cached_tokens": hit}


def in_process(tokens: int, samples: int) -> dict[str, Any]:
    """The agent's own work for one int64 lookup, and hashing alone; ms."""
    backend, [prompt] = fill(tokens // 16, tokens, 16)
    body = prompt.astype("<i8").tobytes()
    hasher = BlockHasher(16)
    ours: list[float] = []
    base: list[float] = []
    try:
        backend.peek(prompt)  # warm up
        for _ in range(samples):
            t0 = time.perf_counter()
            answer = backend.peek(parse_lookup_binary(body, {}).tokens)
            ours.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            hasher.hashes(prompt)
            base.append((time.perf_counter() - t0) * 1e3)
    finally:
        backend.shutdown()
    assert answer is not None and answer["cpu"] == tokens
    return {"lookup_p50_ms": round(pct(ours, 50), 3), "lookup_p99_ms": round(pct(ours, 99), 3),
            "hash_p50_ms": round(pct(base, 50), 3), "hash_p99_ms": round(pct(base, 99), 3),
            "ratio_p99": round(pct(ours, 99) / pct(base, 99), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run (seconds)")
    args = p.parse_args()
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=16, dtype=KVDtype.FLOAT16,
                      tokens_per_block=16)
    tokens = 32768 if not args.quick else 2048
    samples = 1000 if not args.quick else 50
    cpu_bytes = 2 * tokens * layout.bytes_per_token
    work = Path(tempfile.mkdtemp(prefix="fkv-bench-"))
    proc, sock, url = start_agent(work, layout, cpu_bytes)
    bufs = SharedKVBuffers.for_layout(layout, tokens)
    client = EngineClient(sock, RankInfo("bench-0"), timeout=30)
    try:
        client.register_kv_buffers(layout, bufs.handles)
        prompt = np.arange(1, tokens + 1, dtype=np.int64)
        client.store_kv("p", prompt, np.arange(tokens, dtype=np.int64))
        wait_stored(client, "p")
        for binary in (False, True):
            with httpx.Client(base_url=url, timeout=10) as http:
                row = measure(http, tokens, samples, binary)
            emit(bench="lookup_http", body="int64" if binary else "json", tokens=tokens,
                 samples=samples, **row, loadavg=round(os.getloadavg()[0], 2))
        emit(bench="lookup_http", body="int64", where="in_process", tokens=tokens,
             samples=samples, **in_process(tokens, samples),
             loadavg=round(os.getloadavg()[0], 2))
    finally:
        client.close()
        bufs.close()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

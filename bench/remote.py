"""The remote tier (Mooncake Store) against Mooncake's own calls, in one run.

Starts a ``mooncake_master`` on loopback (free ports, built-in metadata server)
and two Mooncake clients in this process standing for two nodes, A and B, each
with an embedded backend, its own CPU tier and its own engine buffers:

* ``remote_load``: A stores a ``--tokens`` prompt and writes it behind to the
  pool; B serves it as a cross-node hit: ``get_match`` (one ``batch_is_exist``,
  a fetch into B's CPU tier through its registered staging buffer) and the load
  into B's engine slots (shuffled whole pages), ``launch`` + ``wait``. The
  baseline is Mooncake's own contiguous ``batch_get_into`` of the same objects
  (same bytes) by B's client into one registered buffer. Timed alternately,
  best of ``--iters``; B's index is reset before every agent round so each one
  fetches again. Goal: ratio >= 0.9.
* ``remote_lookup_miss`` / ``remote_lookup_local_hit``: ``get_match`` latency for
  a ``--lookup-tokens`` prompt with the remote tier on, p50/p99 over
  ``--lookup-iters`` calls, with 16 and with 256 tokens per block (2048 and 128
  objects for 32K tokens): a prompt cached nowhere (the local miss plus the
  remote lookup: one ``batch_is_exist`` of the first blocks, docs/remote.md) and a
  prompt cached in the CPU tier (no remote call). The baseline is the same miss on
  a backend without a remote tier. Goal: p99 <= 1.5 ms for the miss, 2 ms for the
  local hit.
* ``remote_lookup_local_hit_during_fetch``: the p99 of a group leader's lookup
  (a single-stage connector, its decision lock included) of a ``--lookup-tokens``
  prompt cached in its CPU tier, while another request of the same group fetches
  2048 remote blocks after another (``--fetch-prompts`` prompts of 2048 blocks that
  only the pool holds, each looked up once; the CPU tier holds them all, so no
  eviction runs). The baseline is the same lookup with no fetch running; the
  lookups timed are those made while fetches ran. Goal: ratio <= 2.
* ``remote_lookup_local_hit_frozen_peer``: the same local-hit ``get_match`` on one
  stage while another stage of the same agent (same Mooncake client) keeps
  looking up and fetching a prompt held by a peer in another process; p99 with
  the peer alive, then with the peer frozen (SIGSTOP). Goal: the frozen p99
  within 2x of the alive one.

Run: ``python bench/remote.py`` (Llama-3-8B stage: 2 MiB blocks, 2048 tokens =
256 MiB per load; about 30 s on 2 cores) or ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.backend.remote.keys import KeySpace, block_digest
from node_agent.backend.remote.objects import HEADER_BYTES
from node_agent.backend.remote.settings import RemoteSettings
from node_agent.backend.remote.tier import RemotePool, RemoteTier
from node_agent.backend.stage_store import TierStore
from node_agent.vocab.layout import KVDtype, KVLayout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_master(log: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    here = Path(sys.executable).parent / "mooncake_master"
    binary = str(here) if here.exists() else shutil.which("mooncake_master")
    if binary is None:
        raise SystemExit("mooncake_master not found: install the remote extra "
                         "(bash scripts/bootstrap.sh)")
    rpc, http = _free_port(), _free_port()
    proc = subprocess.Popen(
        [binary, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1",
         f"--metrics_port={_free_port()}"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    for port in (rpc, http):
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"mooncake_master did not start; see {log}")
            time.sleep(0.05)
    return proc, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"


def _node(master: str, metadata: str, layout: KVLayout, blocks: int, remote: bool,
          segment: int, timeout: float = 30.0, pool: RemotePool | None = None,
          ) -> tuple[EmbeddedBackend, RemotePool | None, list[torch.Tensor]]:
    tier = None
    if pool is not None:
        tier = RemoteTier(pool, KeySpace(layout))
    elif remote:
        pool = RemotePool(RemoteSettings(
            master_address=master, metadata_server=metadata,
            local_hostname=f"127.0.0.1:{_free_port()}", segment_bytes=segment,
            staging_bytes=2 * blocks * (layout.bytes_per_block + HEADER_BYTES),
            queue_blocks=blocks + 16, timeout_seconds=timeout))
        pool.start(30.0)
        if not pool.health.up:
            raise SystemExit(f"cannot join the Mooncake pool: {pool.health.reason}")
        tier = RemoteTier(pool, KeySpace(layout))
    backend = EmbeddedBackend(EmbeddedBackendConfig(
        layout=layout, cpu_bytes=(blocks + 8) * layout.bytes_per_block, pinned=False),
        remote=tier)
    backend.start()
    slots = blocks * layout.tokens_per_block
    shape = (slots, layout.heads_per_rank, layout.head_size)
    groups = [[torch.zeros(shape, dtype=layout.dtype.torch_dtype)
               for _ in range(layout.num_layers)] for _ in range(layout.kv_dim)]
    backend.register_kv_buffers(0, groups)
    return backend, pool, [t for g in groups for t in g]


def _run(backend: EmbeddedBackend, tokens: np.ndarray, slots: np.ndarray, put: bool) -> int:
    tid, mask = backend.put_match(tokens) if put else backend.get_match(tokens)
    if tid < 0:
        return 0
    [tid] = backend.launch([tid], [slots[mask]])
    status = backend.wait([tid], timeout=120)[tid].status.value
    if status != "success":
        raise SystemExit(f"transfer ended {status}")
    return int(mask.sum())


def bench_load(master: str, metadata: str, tokens_n: int, iters: int) -> dict[str, object]:
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_size=128, dtype=KVDtype.BFLOAT16,
                      tokens_per_block=16)
    blocks = tokens_n // layout.tokens_per_block
    nbytes = blocks * layout.bytes_per_block
    segment = 2 * nbytes + (64 << 20)
    a, pool_a, planes_a = _node(master, metadata, layout, blocks, True, segment)
    b, pool_b, planes_b = _node(master, metadata, layout, blocks, True, segment)
    assert pool_a is not None and pool_b is not None and a.remote and b.remote
    g = torch.Generator().manual_seed(0)
    for p in planes_a:
        p.view(torch.int16).copy_(torch.randint(-32768, 32767, p.shape, generator=g,
                                                dtype=torch.int16))
    tokens = np.arange(tokens_n, dtype=np.int64) + 1
    # SGLang's allocation with page size == tokens per block: shuffled whole pages.
    tpb = layout.tokens_per_block
    pages = np.random.default_rng(1).permutation(blocks).astype(np.int64)
    slots = (pages[:, None] * tpb + np.arange(tpb)).reshape(-1)
    assert _run(a, tokens, slots, put=True) == tokens_n
    if not a.remote.drain(300) or a.remote.written_blocks != blocks:
        raise SystemExit(f"A wrote {a.remote.written_blocks} of {blocks} blocks")
    # Baseline: Mooncake's contiguous batch_get_into of the same objects by B's client.
    # Objects are a header and the block (docs/remote.md): the baseline reads them whole.
    bpb = b.remote.object_bytes
    dst = torch.zeros(blocks * bpb, dtype=torch.uint8)
    pool_b.register(dst)
    keys = b.remote.keyspace.keys([block_digest(h) for h in b._hasher.hashes(tokens)])
    ptrs = [dst.data_ptr() + i * bpb for i in range(blocks)]
    client = pool_b.client()
    assert client is not None
    best_agent = best_base = float("inf")
    for _ in range(iters):
        b.reset()
        t0 = time.perf_counter()
        hit = _run(b, tokens, slots, put=False)
        best_agent = min(best_agent, time.perf_counter() - t0)
        if hit != tokens_n:
            raise SystemExit(f"B hit {hit} of {tokens_n} tokens")
        t0 = time.perf_counter()
        codes = client.batch_get_into(keys, ptrs, [bpb] * blocks)
        best_base = min(best_base, time.perf_counter() - t0)
        if any(c != bpb for c in codes):
            raise SystemExit(f"baseline batch_get_into answered {set(codes)}")
    for i, (pa, pb) in enumerate(zip(planes_a, planes_b, strict=True)):
        idx = torch.from_numpy(slots)
        if not torch.equal(pa.view(torch.int16)[idx], pb.view(torch.int16)[idx]):
            raise SystemExit(f"plane {i}: B loaded other bytes than A stored")
    agent_gbs, base_gbs = nbytes / best_agent / 1e9, nbytes / best_base / 1e9
    for x in (a, b):
        x.shutdown()
    pool_a.close()
    pool_b.close()
    return {"bench": "remote", "row": "remote_load", "tokens": tokens_n, "bytes": nbytes,
            "gbps": round(agent_gbs, 3), "baseline": "mooncake batch_get_into (contiguous)",
            "baseline_gbps": round(base_gbs, 3), "ratio": round(agent_gbs / base_gbs, 3),
            "goal": ">= 0.9", "met": agent_gbs / base_gbs >= 0.9}


def _latencies(fn, iters: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return np.asarray(out) * 1e3


def bench_lookup(master: str, metadata: str, tokens_n: int, tpb: int,
                 iters: int) -> list[dict[str, object]]:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=1, kv_dim=1,
                      dtype=KVDtype.FLOAT16, tokens_per_block=tpb)
    blocks = tokens_n // tpb
    on, pool, _ = _node(master, metadata, layout, blocks, True, 64 << 20)
    off, _, _ = _node(master, metadata, layout, blocks, False, 0)
    rng = np.random.default_rng(2)
    slots = np.arange(tokens_n, dtype=np.int64)
    cached = rng.integers(1, 1 << 40, tokens_n, dtype=np.int64)
    assert _run(on, cached, slots, put=True) == tokens_n

    def miss(backend: EmbeddedBackend) -> None:
        tid, _ = backend.get_match(rng.integers(1, 1 << 40, tokens_n, dtype=np.int64))
        assert tid < 0

    def hit() -> None:
        tid, _ = on.get_match(cached)
        on.cancel([tid])

    for _ in range(20):  # warm up
        miss(on)
        miss(off)
    base = _latencies(lambda: miss(off), iters)
    rows = []
    for row, fn, goal in (("remote_lookup_miss", lambda: miss(on), 1.5),
                          ("remote_lookup_local_hit", hit, 2.0)):
        lat = _latencies(fn, iters)
        p99 = float(np.percentile(lat, 99))
        rows.append({
            "bench": "remote", "row": row, "tokens": tokens_n, "tokens_per_block": tpb,
            "objects": blocks, "p50_ms": round(float(np.percentile(lat, 50)), 3),
            "p99_ms": round(p99, 3), "baseline": "local miss without a remote tier",
            "baseline_p50_ms": round(float(np.percentile(base, 50)), 3),
            "baseline_p99_ms": round(float(np.percentile(base, 99)), 3),
            "ratio_p99": round(p99 / float(np.percentile(base, 99)), 3),
            "goal": f"p99 <= {goal} ms", "met": p99 <= goal})
    assert pool is not None
    on.shutdown()
    off.shutdown()
    pool.close()
    return rows


def bench_lookup_during_fetch(master: str, metadata: str, tokens_n: int, iters: int,
                              prompts: int) -> dict[str, object]:
    from node_agent.coordinator import Coordinator, CoordinatorConfig
    from node_agent.pp.group import GroupViewSource
    from node_agent.vocab.group_view import GroupMember, GroupView

    tpb, fetch_blocks = 16, 2048
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=1, kv_dim=1,
                      dtype=KVDtype.FLOAT16, tokens_per_block=tpb)
    local_blocks = tokens_n // tpb
    writer, pool_a, _ = _node(master, metadata, layout, prompts * fetch_blocks, True, 64 << 20)
    assert writer.remote is not None
    rng = np.random.default_rng(3)
    remote_prompts = [rng.integers(1, 1 << 40, fetch_blocks * tpb, dtype=np.int64)
                      for _ in range(prompts)]
    for tokens in remote_prompts:
        slots = np.arange(len(tokens), dtype=np.int64)
        assert _run(writer, tokens, slots, put=True) == len(tokens)
        if not writer.remote.drain(300):
            raise SystemExit("the writer did not drain")
    if writer.remote.written_blocks != prompts * fetch_blocks:
        raise SystemExit(f"wrote {writer.remote.written_blocks} of {prompts * fetch_blocks}")

    pool = RemotePool(RemoteSettings(
        master_address=master, metadata_server=metadata,
        local_hostname=f"127.0.0.1:{_free_port()}", segment_bytes=64 << 20,
        staging_bytes=2 * fetch_blocks * (layout.bytes_per_block + HEADER_BYTES),
        queue_blocks=16,
        timeout_seconds=30.0))
    pool.start(30.0)
    if not pool.health.up:
        raise SystemExit(f"cannot join the Mooncake pool: {pool.health.reason}")
    cpu_blocks = local_blocks + prompts * fetch_blocks + 64
    cfg = CoordinatorConfig(group="bench", pp_rank=0, layout=layout,
                          engine_call_seconds=60.0, fanout_wait_seconds=10.0,
                          transfer_seconds=15.0)
    me = GroupMember(node="bench", pp_rank=0, fanout_endpoint="")

    def no_store() -> TierStore:
        raise AssertionError("a single-stage group has no follower")

    conn = Coordinator(
        cfg, GroupViewSource(GroupView("bench", 0, me, (me,))),
        backend_factory=lambda: EmbeddedBackend(
            EmbeddedBackendConfig(layout=layout, cpu_bytes=cpu_blocks * layout.bytes_per_block,
                                  pinned=False, deferred_visibility=True),
            remote=RemoteTier(pool, KeySpace(layout))),
        store_factory=no_store, keys=None).start()
    shape = (tokens_n, layout.heads_per_rank, layout.head_size)
    conn.register_kv_buffers(0, [[torch.zeros(shape, dtype=torch.float16)]])
    local = rng.integers(1, 1 << 40, tokens_n, dtype=np.int64)
    if conn.store_kv("store", local, torch.arange(tokens_n)) < 0:
        raise SystemExit("the local prompt was not stored")
    deadline = time.monotonic() + 60
    while "store" not in conn.poll_completed():
        if time.monotonic() > deadline:
            raise SystemExit("the local store did not complete")
        time.sleep(0.01)
    conn.release("store")

    def lookup() -> None:
        if conn.lookup("local", local) != tokens_n:
            raise SystemExit("the local prompt is not a full hit")
        conn.release("local")

    for _ in range(20):
        lookup()
    base = _latencies(lookup, iters)
    stop, fetched, errors = threading.Event(), [0], []

    def fetch_loop() -> None:
        for tokens in remote_prompts:
            hit = conn.lookup("fetch", tokens)
            conn.release("fetch")
            if hit != fetch_blocks * tpb:
                errors.append(hit)
                return
            fetched[0] += 1
        stop.set()

    fetcher = threading.Thread(target=fetch_loop, daemon=True)
    fetcher.start()
    out = []
    while not stop.is_set() and not errors and len(out) < iters:
        t0 = time.perf_counter()
        lookup()
        out.append(time.perf_counter() - t0)
    during = np.asarray(out) * 1e3
    fetcher.join(300)
    if errors:
        raise SystemExit(f"a remote prompt hit {errors[0]} tokens, not {fetch_blocks * tpb}")
    conn.close()
    pool.close()
    writer.shutdown()
    assert pool_a is not None
    pool_a.close()
    p99, b99 = float(np.percentile(during, 99)), float(np.percentile(base, 99))
    return {"bench": "remote", "row": "remote_lookup_local_hit_during_fetch",
            "tokens": tokens_n, "tokens_per_block": tpb, "fetch_blocks": fetch_blocks,
            "fetches_during": fetched[0], "lookups_during": len(during),
            "p50_ms": round(float(np.percentile(during, 50)), 3),
            "p99_ms": round(p99, 3), "baseline": "the same lookup with no fetch running",
            "baseline_p50_ms": round(float(np.percentile(base, 50)), 3),
            "baseline_p99_ms": round(b99, 3), "ratio_p99": round(p99 / b99, 3),
            "goal": "ratio_p99 <= 2", "met": p99 <= 2 * b99}


def _lookup_layout(tpb: int) -> KVLayout:
    return KVLayout(num_layers=1, num_kv_heads=1, head_size=1, kv_dim=1,
                    dtype=KVDtype.FLOAT16, tokens_per_block=tpb)


def _peer_tokens(tokens_n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(1, 1 << 40, tokens_n, dtype=np.int64)


def run_peer(master: str, metadata: str, tokens_n: int, tpb: int) -> None:
    """The peer process: store a prompt into the pool (its own segment), then idle."""
    layout = _lookup_layout(tpb)
    blocks = tokens_n // tpb
    node, pool, _ = _node(master, metadata, layout, blocks, True, 64 << 20, timeout=2.0)
    assert pool is not None and node.remote is not None
    tokens = _peer_tokens(tokens_n)
    assert _run(node, tokens, np.arange(tokens_n, dtype=np.int64), put=True) == tokens_n
    if not node.remote.drain(120) or node.remote.written_blocks != blocks:
        raise SystemExit(f"the peer wrote {node.remote.written_blocks} of {blocks} blocks")
    print("ready", flush=True)
    time.sleep(3600)


def bench_frozen_peer(master: str, metadata: str, tokens_n: int, tpb: int,
                      iters: int) -> dict[str, object]:
    layout = _lookup_layout(tpb)
    blocks = tokens_n // tpb
    peer = subprocess.Popen([sys.executable, __file__, "--peer", master, metadata,
                             str(tokens_n), str(tpb)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert peer.stdout is not None
        if peer.stdout.readline().strip() != b"ready":
            raise SystemExit("the peer process did not store its prompt")
        pool = RemotePool(RemoteSettings(
            master_address=master, metadata_server=metadata,
            local_hostname=f"127.0.0.1:{_free_port()}", segment_bytes=64 << 20,
            staging_bytes=2 * blocks * (layout.bytes_per_block + HEADER_BYTES),
            queue_blocks=blocks + 16, timeout_seconds=2.0))
        pool.start(30.0)
        if not pool.health.up:
            raise SystemExit(f"cannot join the Mooncake pool: {pool.health.reason}")
        local, _, _ = _node(master, metadata, layout, blocks, True, 0, pool=pool)
        other, _, _ = _node(master, metadata, layout, blocks, True, 0, pool=pool)
        cached = np.random.default_rng(3).integers(1, 1 << 40, tokens_n, dtype=np.int64)
        assert _run(local, cached, np.arange(tokens_n, dtype=np.int64), put=True) == tokens_n
        theirs = _peer_tokens(tokens_n)

        def hit() -> None:
            tid, mask = local.get_match(cached)
            assert int(mask.sum()) == tokens_n
            local.cancel([tid])

        def phase() -> tuple[np.ndarray, int, int]:
            stop, fetched, rounds = False, [0], [0]

            def traffic() -> None:  # the other stage: remote lookups and fetches
                while not stop:
                    tid, mask = other.get_match(theirs)
                    fetched[0] += int(mask.sum())
                    rounds[0] += 1
                    if tid >= 0:
                        other.cancel([tid])
                    other.reset()

            t = threading.Thread(target=traffic, daemon=True)
            t.start()
            time.sleep(0.5)
            out, end = [], time.monotonic() + 8.0  # several fetch timeouts (2 s) long
            while len(out) < iters or time.monotonic() < end:
                t0 = time.perf_counter()
                hit()
                out.append(time.perf_counter() - t0)
                time.sleep(0.002)  # a stream of requests, not a busy loop
            lat = np.asarray(out) * 1e3
            stop = True
            t.join(60)
            return lat, rounds[0], fetched[0]

        for _ in range(20):
            hit()
        alive, alive_rounds, alive_tokens = phase()
        peer.send_signal(signal.SIGSTOP)
        frozen, frozen_rounds, frozen_tokens = phase()
        a99, f99 = float(np.percentile(alive, 99)), float(np.percentile(frozen, 99))
        peer.send_signal(signal.SIGCONT)
        peer.kill()  # calls still waiting on it end before the client is closed
        local.shutdown()
        other.shutdown()
        pool.close()
        return {"bench": "remote", "row": "remote_lookup_local_hit_frozen_peer",
                "tokens": tokens_n, "tokens_per_block": tpb, "objects": blocks,
                "samples": {"alive": len(alive), "frozen": len(frozen)},
                "p50_ms": round(float(np.percentile(frozen, 50)), 3), "p99_ms": round(f99, 3),
                "baseline": "the same lookup with the peer alive",
                "baseline_p50_ms": round(float(np.percentile(alive, 50)), 3),
                "baseline_p99_ms": round(a99, 3), "ratio_p99": round(f99 / a99, 3),
                "other_stage_rounds": {"alive": alive_rounds, "frozen": frozen_rounds},
                "other_stage_fetched_tokens": {"alive": alive_tokens, "frozen": frozen_tokens},
                "goal": "p99 within 2x of the peer alive", "met": f99 <= 2 * a99}
    finally:
        peer.send_signal(signal.SIGCONT)
        peer.kill()
        peer.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--lookup-tokens", type=int, default=32768)
    ap.add_argument("--lookup-tpb", default="16,256",
                    help="tokens per block of the lookup rows, comma-separated")
    ap.add_argument("--lookup-iters", type=int, default=200)
    ap.add_argument("--fetch-prompts", type=int, default=16,
                    help="2048-block prompts fetched while the during-fetch row is timed")
    ap.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    ap.add_argument("--peer", nargs=4, metavar=("MASTER", "METADATA", "TOKENS", "TPB"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        run_peer(args.peer[0], args.peer[1], int(args.peer[2]), int(args.peer[3]))
        return
    if args.quick:
        args.tokens, args.iters, args.lookup_iters = 512, 2, 30
    with tempfile.TemporaryDirectory(prefix="fkv-bench-remote-") as tmp:
        proc, master, metadata = _start_master(Path(tmp) / "master.log")
        try:
            print(json.dumps(bench_load(master, metadata, args.tokens, args.iters)), flush=True)
            for tpb in (int(t) for t in str(args.lookup_tpb).split(",")):
                for row in bench_lookup(master, metadata, args.lookup_tokens, tpb,
                                        args.lookup_iters):
                    print(json.dumps(row), flush=True)
            print(json.dumps(bench_lookup_during_fetch(
                master, metadata, args.lookup_tokens, args.lookup_iters, args.fetch_prompts)),
                flush=True)
            print(json.dumps(bench_frozen_peer(master, metadata, args.lookup_tokens, 256,
                                               args.lookup_iters)), flush=True)
        finally:
            proc.kill()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()

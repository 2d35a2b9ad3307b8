"""Two TP ranks of one stage, each its own process with its own KV buffers, one
real agent (``expectedRanks: 2``): TP rank 0 makes the agent calls, which move both
ranks' KV; rank 1 takes rank 0's answers over a real gloo group. Both ranks see
the same task, hit and load, and each rank's own heads come back bit-exactly."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import socket

import pytest

from node_agent.engine_api.protocol import layout_to_wire
from node_agent.vocab.layout import KVDtype, KVLayout
from tests.agent.harness import (
    agent_process,
    short_dir,
)
from tests.sglang.tp_rank import tp_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_size=8, dtype=KVDtype.FLOAT16,
                  tokens_per_block=4, tp_size=2)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tp_rank0_calls_the_agent_and_every_rank_gets_its_answers() -> None:
    work = short_dir("sgltp")
    procs = []
    try:
        with agent_process(work, expectedRanks=2) as agent:
            try:
                ctx = mp.get_context("forkserver")
                ctx.set_forkserver_preload(["tests.sglang.tp_rank"])
                port = _port()
                pipes = []
                for r in range(2):
                    parent, child = ctx.Pipe()
                    p = ctx.Process(target=tp_main, daemon=True,
                                    args=(agent.socket, json.dumps(layout_to_wire(LAYOUT)),
                                          r, 2, port, child))
                    p.start()
                    child.close()
                    procs.append(p)
                    pipes.append(parent)
                reports = []
                for r, pipe in enumerate(pipes):
                    assert pipe.poll(120), f"TP rank {r} did not finish (a hang)"
                    kind, value = pipe.recv()
                    assert kind == "ok", value
                    reports.append(value)
                r0, r1 = reports
                assert r0["connected"] and r1["connected"]
                assert r0["task"] >= 0 and r0["task"] == r1["task"]
                assert r0["completed"] == r1["completed"] == ["tp-store"]
                assert r0["lookup"] == r1["lookup"] and r0["lookup"][1] == 32
                assert r0["loaded"] == r1["loaded"] == 32
                assert r0["exact"] is True and r1["exact"] is True  # each rank's own heads
                want = "store_kv: token_ids has 3 entries but kv_indices has 2 entries"
                assert r0["length_error"] == r1["length_error"] == want
                assert r0["miss"] == r1["miss"] == [-1, 0]
            finally:
                for p in procs:
                    p.join(10)
                    if p.is_alive():
                        p.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)

"""Invariant 5 across a real PP group: with small timeouts and a stalled follower,
the leader stage's engine gets its answer only after the connector gave up, and
nothing is written into its slots after that answer.

Two agents (leader pp0, follower pp1) run in this event loop on loopback, with
real fan-out sockets and engine sockets; engine calls go through the client
library from worker threads. The follower's engine "stalls": it calls retrieve
only after the leader's engine was answered.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.pp.auth import CurveKeys
from node_agent.vocab.budget import call_budget
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    agent_mapping,
    cfg_of,
    running_agent,
    wait_http,
    wait_stored,
    write_group_file,
)

pytestmark = pytest.mark.timeout(90)
ENGINE_CALL, FANOUT_WAIT = 2.0, 0.6


async def _both(*calls: object) -> list[object]:
    return list(await asyncio.gather(*(asyncio.to_thread(*c) for c in calls)))  # type: ignore[misc]


async def _store_everywhere(clients: list[EngineClient], rid: str, tokens: np.ndarray,
                            slots: np.ndarray) -> None:
    results = await _both(*[(c.store_kv, rid, tokens, slots) for c in clients])
    assert all(isinstance(r, int) and r >= 0 for r in results), results
    await wait_stored(clients[0], rid)


async def test_answer_comes_after_the_connector_gave_up_and_nothing_writes_later(
        work: Path) -> None:
    CurveKeys.generate().write(work / "curve")
    timeouts = {"engineCallSeconds": ENGINE_CALL, "fanoutWaitSeconds": FANOUT_WAIT}
    maps = [agent_mapping(work, f"node-{r}", groupViewFile=str(work / "groups.yaml"),
                          timeouts=timeouts) for r in (0, 1)]
    write_group_file(work / "groups.yaml", "tp", "rep",
                     {r: m["ports"]["fanout"] for r, m in enumerate(maps)})
    cfgs = [cfg_of(m) for m in maps]
    bufs = [SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS) for _ in range(2)]
    clients = [EngineClient(c.engine_socket, RankInfo("rep", pp_rank=r, pp_size=2), timeout=10)
               for r, c in enumerate(cfgs)]
    budget = call_budget(ENGINE_CALL, FANOUT_WAIT)
    try:
        async with running_agent(cfgs[0]) as lead, running_agent(cfgs[1]) as foll:
            for c, b in zip(clients, bufs, strict=True):
                await asyncio.to_thread(c.register_kv_buffers, LAYOUT, b.handles)
            for ra in (lead, foll):
                await wait_http(ra, "/readyz", 200, 20)
            tokens = np.arange(16, dtype=np.int64)
            src = np.arange(16, dtype=np.int64)
            for b in bufs:
                for group in b.tensors:
                    for t in group:
                        t[:16] = 1.0
            await _store_everywhere(clients, "s", tokens, src)
            hits = await _both(*[(c.lookup, "g", tokens) for c in clients])
            assert hits == [16, 16]

            dst = np.arange(100, 116, dtype=np.int64)
            sentinel = -7.0
            for group in bufs[0].tensors:
                for t in group:
                    t[100:116] = sentinel
            # The follower's engine stalls: only the leader's engine calls retrieve.
            # The connector gives up on its own (a miss) inside engineCallSeconds: the
            # engine never sees the server's last-resort TimeoutError.
            assert await asyncio.to_thread(clients[0].retrieve, "g", dst) == 0
            # Now the stalled follower wakes up and loads; the leader must not.
            assert await asyncio.to_thread(clients[1].retrieve, "g", dst) == 0
            # No event marks "a late copy would have landed by now": the wait gives
            # any copy of the leader's abandoned load its whole transfer budget twice.
            await asyncio.sleep(budget.transfer_seconds * 2)
            for group in bufs[0].tensors:
                for t in group:
                    assert torch.all(t[100:116] == sentinel), "leader slots written after answer"
            status = (await lead.get("/status")).json()
            assert not [e for e in status["recentErrors"] if "InternalError" in e["message"]]
            assert status["stages"][0]["connector"]["role"] == "leader"
    finally:
        for c in clients:
            c.close()
        for b in bufs:
            b.close()

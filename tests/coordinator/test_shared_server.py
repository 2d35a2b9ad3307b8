"""One agent in two PP groups: both connectors share the agent's single fan-out
server (one port), and each group's stream reaches only its own connector."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from node_agent.coordinator import Coordinator
from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import FanoutServer
from node_agent.pp.group import GroupViewSource
from node_agent.vocab.group_view import GroupView
from tests.coordinator.harness import (
    LAYOUT,
    Buffers,
    group_status,
    kv_content,
    make_coordinator,
    read_slots,
    started,
    wait_completed,
    write_slots,
)
from tests.support.group_views import update_status
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block
Stage = tuple[Coordinator, Buffers]


def _stage(rank: int, group: str, keys: CurveKeys, server: FanoutServer | None) -> Stage:
    view = GroupViewSource(GroupView(group, 0, None, ()))
    return started(make_coordinator(rank, view, keys, endpoint="tcp://127.0.0.1:0",
                                  server=server))


@pytest.fixture
def two_groups() -> Iterator[dict[str, list[Stage]]]:
    keys = CurveKeys.generate()
    shared = FanoutServer("tcp://127.0.0.1:0", keys).start()
    groups: dict[str, list[Stage]] = {}
    try:
        for g in ("g-a", "g-b"):
            leader = _stage(0, g, keys, None)
            follower = _stage(1, g, keys, shared)  # both followers live on one agent
            groups[g] = [leader, follower]
            eps = {0: str(leader[0].fanout_endpoint), 1: shared.endpoint}
            for conn, _ in groups[g]:
                update_status(conn._view, group_status(1, 0, eps))
        wait_for(lambda: all(c.ready() for st in groups.values() for c, _ in st),
                 "every stage of both groups ready")
        yield groups
    finally:
        for st in groups.values():
            for conn, _ in st:
                conn.close()
        shared.close()


def test_groups_share_one_fanout_port_without_crosstalk(
        two_groups: dict[str, list[Stage]]) -> None:
    with ThreadPoolExecutor(4) as pool:
        for gi, (g, stages) in enumerate(two_groups.items()):
            tokens = np.arange(100 * gi, 100 * gi + 3 * TPB)
            jobs = []
            for rank, (conn, bufs) in enumerate(stages):
                src = np.arange(10 * rank, 10 * rank + len(tokens))
                write_slots(bufs, src, kv_content(rank, tokens))
                jobs.append(pool.submit(conn.store_kv, "r", tokens, src))
            tasks = [j.result(timeout=10) for j in jobs]
            assert tasks[0] >= 0 and tasks[0] == tasks[1], (g, tasks)
            for conn, _ in stages:
                wait_completed(conn, "r", 10)
            hits = [pool.submit(c.lookup, "q", tokens) for c, _ in stages]
            assert [h.result(timeout=10) for h in hits] == [3 * TPB, 3 * TPB]
            dst = np.arange(400, 400 + 3 * TPB)
            loads = [pool.submit(c.retrieve, "q", dst) for c, _ in stages]
            assert [f.result(timeout=15) for f in loads] == [3 * TPB, 3 * TPB]
            for rank, (_, bufs) in enumerate(stages):
                np.testing.assert_array_equal(read_slots(bufs, dst), kv_content(rank, tokens))
    for st in two_groups.values():
        s = st[1][0].status()
        assert s["dropped"].get("unknown_group", 0) == 0 and not s["degraded"]

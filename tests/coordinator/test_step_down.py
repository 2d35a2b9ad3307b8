"""A stale leader steps down as soon as it learns of a newer epoch, before its
group view changes: it stops deciding, answers engine calls with -1 / a miss at
once, and discards (never publishes) its in-flight stores.

In-process, over real Curve pyzmq sockets on loopback: the leader is a real
:class:`Coordinator` with the embedded backend; its one follower is a bare
:class:`FollowerStream` that records what it applies and never acks, so a store
stays in flight until something ends it. The newer epoch arrives either as the
new leader's heartbeat (this stage is a follower in the new view) or as a
follower's HELLO under the new epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from node_agent.coordinator import Coordinator
from node_agent.metrics import AgentMetrics
from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import FanoutServer, Sender
from node_agent.pp.group import GroupViewSource
from node_agent.pp.messages import Envelope, Heartbeat, Hello, Message, Op, Result, encode
from node_agent.pp.stream import FollowerStream, StreamMetrics
from node_agent.vocab.group_view import GroupView
from tests.coordinator.harness import (
    GROUP,
    LAYOUT,
    group_status,
    kv_content,
    make_coordinator,
    started,
    write_slots,
)
from tests.support.group_views import update_status
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block


@dataclass
class StaleLeader:
    conn: Coordinator
    metrics: AgentMetrics
    keys: CurveKeys
    bufs: tuple[list, list]  # type: ignore[type-arg]
    follower: FollowerStream
    applied: list[Message] = field(default_factory=list)

    def results(self) -> list[Result]:
        return [m.body for m in self.applied if isinstance(m.body, Result)]


@pytest.fixture
def stale() -> Iterator[StaleLeader]:
    keys = CurveKeys.generate()
    metrics = AgentMetrics()
    f_server = FanoutServer("tcp://127.0.0.1:0", keys).start()
    view = GroupViewSource(GroupView(GROUP, 0, None, ()))
    # A long engine-call deadline: an in-flight store ending early proves the step-down.
    conn, bufs = started(make_coordinator(0, view, keys, metrics=metrics,
                                        engine_call_seconds=60.0))
    applied: list[Message] = []
    follower = FollowerStream(GROUP, 1, keys, StreamMetrics(GROUP, None), apply=applied.append,
                              on_unsynced=lambda r: None, on_dropped=lambda m: None,
                              hello_interval=0.05)
    f_server.register(GROUP, follower.handle)
    assert conn.fanout_endpoint is not None
    update_status(view, group_status(1, 0, {0: conn.fanout_endpoint,
                                                1: f_server.endpoint}))
    follower.follow(1, conn.fanout_endpoint)
    s = StaleLeader(conn, metrics, keys, bufs, follower, applied)
    try:
        wait_for(conn.ready, "leader ready with its follower synced")
        yield s
    finally:
        follower.close()
        conn.close()
        f_server.close()


def _newer_epoch_heartbeat(s: StaleLeader) -> None:
    """The epoch-2 leader's stream reaches this stage (a follower in its view)."""
    sender = Sender(s.conn.fanout_endpoint or "", s.keys)
    try:
        sender.send(encode(Envelope(Op.HEARTBEAT, GROUP, 2, 0), Heartbeat()))
        wait_for(lambda: s.conn.status().get("steppedDownFor") == 2, "step-down")
    finally:
        sender.close()


def _newer_epoch_hello(s: StaleLeader) -> None:
    """A follower moved to epoch 2 and (still) says HELLO to this stage."""
    sender = Sender(s.conn.fanout_endpoint or "", s.keys)
    try:
        sender.send(encode(Envelope(Op.HELLO, GROUP, 2, -1), Hello(1, 7, 0, False)))
        wait_for(lambda: s.conn.status().get("steppedDownFor") == 2, "step-down")
    finally:
        sender.close()


@pytest.mark.parametrize("signal", [_newer_epoch_heartbeat, _newer_epoch_hello],
                         ids=["new-leader-heartbeat", "follower-hello"])
def test_stale_leader_steps_down_on_a_newer_epoch(
        stale: StaleLeader, signal: Callable[[StaleLeader], None]) -> None:
    conn, bufs = stale.conn, stale.bufs
    tokens = np.arange(500, 500 + 4 * TPB)
    slots = np.arange(4 * TPB)
    write_slots(bufs, slots, kv_content(0, tokens))
    task = conn.store_kv("inflight", tokens, slots)
    assert task >= 0  # decided; the follower never acks, so it stays in flight
    assert conn.status()["inflightStores"] == 1

    signal(stale)

    # The in-flight store is discarded and reported long before its 60 s deadline.
    done: list[str] = []
    wait_for(lambda: bool(done.extend(conn.poll_completed()) or "inflight" in done),
             "the in-flight store to end")
    st = conn.status()
    assert (st["role"], st["epoch"], st["degraded"], st["ready"]) == ("leader", 1, True, False)
    assert st["counters"]["stores_discarded"] == 1 and st["counters"]["stores_published"] == 0
    wait_for(lambda: any(r.rid == "inflight" for r in stale.results()), "the RESULT")
    assert [r.ok for r in stale.results() if r.rid == "inflight"] == [False]

    # Every engine call now answers at once (the refusal path, which waits on no
    # ack or deadline: counted below): not stored, a miss; nothing is decided.
    other = np.arange(900, 900 + 2 * TPB)
    assert conn.store_kv("after", other, np.arange(100, 100 + 2 * TPB)) == -1
    assert conn.lookup("look", tokens) == 0
    backend = conn._role.backend  # type: ignore[union-attr]
    assert backend.stats().tasks.get("matched", 0) == 0
    st = conn.status()
    assert st["counters"]["stepped_down_refusals"] == 2
    assert stale.metrics.registry.get_sample_value(
        "flexkv_agent_leader_step_downs_total", {"group": GROUP}) == 1.0
    assert stale.metrics.registry.get_sample_value(
        "flexkv_agent_fanout_dropped_total", {"group": GROUP, "reason": "future_epoch"}) == 1.0


def test_older_epoch_does_not_make_a_leader_step_down(stale: StaleLeader) -> None:
    sender = Sender(stale.conn.fanout_endpoint or "", stale.keys)
    try:
        sender.send(encode(Envelope(Op.HEARTBEAT, GROUP, 0, 0), Heartbeat()))
        wait_for(lambda: stale.conn.status()["dropped"].get("stale_epoch", 0) == 1,
                 "the old-epoch message to be dropped")
    finally:
        sender.close()
    st = stale.conn.status()
    assert st["steppedDownFor"] is None and st["ready"]
    tokens = np.arange(2 * TPB)
    assert stale.conn.store_kv("ok", tokens, np.arange(2 * TPB)) >= 0

"""A follower follows the current leader *process* (docs/invariants.md,
invariant 9): a leader agent restarted under the same epoch,
at a new address or at the same one, is followed at once, and a follower
reports itself degraded until it has synced with it.

The group tests run 3 stage processes over real Curve-authenticated pyzmq
sockets; the leader is killed with SIGKILL and a fresh process takes its
place. The last test drives one follower role message by message.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from node_agent.backend.stage_store import TierStore
from node_agent.coordinator import CoordinatorConfig
from node_agent.coordinator.follower import FollowerRole
from node_agent.pp.auth import CurveKeys
from node_agent.pp.messages import Envelope, Heartbeat, Message, Op, Release, Sync
from node_agent.pp.stream import StreamMetrics

from .harness import GROUP, LAYOUT, NUM_SLOTS, backend_config, make_buffers
from .procs import Group
from .test_group import load_and_check, store, wait_completed

pytestmark = pytest.mark.slow
TPB = LAYOUT.tokens_per_block
FOLLOWERS = (1, 2)


@pytest.fixture
def group() -> Iterator[Group]:
    g = Group(3, CurveKeys.generate(), cpu_blocks=32)
    try:
        g.publish_view(1, 0)
        g.wait_ready()
        yield g
    finally:
        g.close()


def _incarnations(g: Group) -> set[object]:
    return {g.stages[r].call("status").get("leaderIncarnation") for r in FOLLOWERS}


def _round_trip(g: Group, rid: str, tokens: list[int], rng: random.Random) -> None:
    tasks = store(g, rid, tokens, rng)
    assert len(set(tasks.values())) == 1 and tasks[0] >= 0, tasks
    wait_completed(g, rid)
    assert load_and_check(g, f"{rid}-load", tokens, rng) == len(tokens)


def test_leader_restarted_at_a_new_address_under_the_same_epoch_is_followed(
        group: Group) -> None:
    rng = random.Random(41)
    _round_trip(group, "before", list(range(10, 10 + 2 * TPB)), rng)
    [old] = _incarnations(group)
    group.restart(0, kill=True)
    # The new process gets the view first (same epoch: the operator keeps the
    # leader by node and rank); its heartbeats reach the followers, which still
    # hold the old address: they must report degraded, never ready.
    group.publish_view(1, 0, ranks=[0])
    deadline = time.monotonic() + 15
    while any(group.stages[r].call("ready") for r in FOLLOWERS):
        assert time.monotonic() < deadline, "followers kept reporting ready"
        time.sleep(0.05)
    assert all(group.stages[r].call("status")["gauges"]["degraded"] == 1.0 for r in FOLLOWERS)
    group.publish_view(1, 0, ranks=FOLLOWERS)  # the new leader endpoint
    group.wait_ready(timeout=20)
    [new] = _incarnations(group)
    assert new is not None and new != old
    assert all(group.stages[r].call("status")["gauges"]["degraded"] == 0.0 for r in FOLLOWERS)
    _round_trip(group, "after", list(range(500, 500 + 3 * TPB)), rng)


def test_leader_restarted_at_the_same_address_is_followed_at_once(group: Group) -> None:
    rng = random.Random(43)
    for i in range(12):  # the old leader's stream seq runs well ahead of a new one's
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + TPB))
        tasks = store(group, f"w{i}", tokens, rng)
        assert tasks[0] >= 0
    wait_completed(group, "w11")
    old_seq = group.stages[1].call("status")["lastSeq"]
    assert old_seq >= 24
    [old] = _incarnations(group)
    group.restart(0, kill=True, same_address=True)
    group.publish_view(1, 0, ranks=[0])  # the followers' view does not change at all
    group.wait_ready(timeout=20)
    [new] = _incarnations(group)
    assert new is not None and new != old
    assert group.stages[1].call("status")["lastSeq"] < old_seq  # the new stream's seqs
    _round_trip(group, "after", list(range(500, 500 + 2 * TPB)), rng)


# -- one follower driven by hand ----------------------------------------------------------


def test_a_new_incarnation_makes_the_follower_degraded_until_its_sync() -> None:
    cfg = CoordinatorConfig(group=GROUP, pp_rank=1, layout=LAYOUT, engine_call_seconds=2.0,
                          fanout_wait_seconds=0.5, transfer_seconds=0.4)
    store_ = TierStore(backend_config(8, True))
    store_.register_kv_buffers(0, make_buffers())
    stats = StreamMetrics(GROUP, None)
    role = FollowerRole(cfg, 1, None, store_, None, stats, NUM_SLOTS)
    try:
        role.start()

        def deliver(op: Op, seq: int, inc: int, body: object) -> None:
            role.handle(Message(Envelope(op, GROUP, 1, seq, incarnation=inc), body))  # type: ignore[arg-type]

        deliver(Op.SYNC, 50, 111, Sync(1, 1))
        assert role.stream.synced and not role.degraded()
        deliver(Op.RELEASE, 51, 111, Release("a"))
        # A restarted leader: same epoch, its own seqs from 0, a new incarnation.
        deliver(Op.HEARTBEAT, 3, 222, Heartbeat())
        assert role.degraded() and not role.stream.synced
        assert stats.dropped.get("new_incarnation") == 1
        deliver(Op.RELEASE, 4, 222, Release("b"))  # before its SYNC: never applied
        assert role.stream.last_seq == 51
        deliver(Op.SYNC, 4, 222, Sync(1, 2))
        assert role.stream.synced and role.stream.incarnation == 222
        assert role.stream.last_seq == 4 and not role.degraded()
        assert role.counters.resets == 1  # local state flushed for the new process
        deliver(Op.HEARTBEAT, 60, 111, Heartbeat())  # the old process: left for good
        assert role.stream.synced and stats.dropped.get("stale_incarnation") == 1
        deliver(Op.RELEASE, 5, 222, Release("c"))
        assert role.stream.last_seq == 5
    finally:
        role.close()
        store_.close()

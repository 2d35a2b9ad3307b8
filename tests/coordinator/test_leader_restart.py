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

import pytest

from node_agent.pp.messages import Heartbeat, Op, Release, Sync
from tests.coordinator.harness import LAYOUT, HandFedFollower
from tests.coordinator.procs import Group, load_and_check, store, wait_completed
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow
TPB = LAYOUT.tokens_per_block
FOLLOWERS = (1, 2)


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
    wait_for(lambda: not any(group.stages[r].call("ready") for r in FOLLOWERS),
             "the followers to stop reporting ready", 15, interval=0.05)
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
    with HandFedFollower() as f:
        role, stats = f.role, f.stats
        f.deliver(Op.SYNC, 50, Sync(1, 1), 111)
        assert role.stream.synced and not role.degraded()
        f.deliver(Op.RELEASE, 51, Release("a"), 111)
        # A restarted leader: same epoch, its own seqs from 0, a new incarnation.
        f.deliver(Op.HEARTBEAT, 3, Heartbeat(), 222)
        assert role.degraded() and not role.stream.synced
        assert stats.dropped.get("new_incarnation") == 1
        f.deliver(Op.RELEASE, 4, Release("b"), 222)  # before its SYNC: never applied
        assert role.stream.last_seq == 51
        f.deliver(Op.SYNC, 4, Sync(1, 2), 222)
        assert role.stream.synced and role.stream.incarnation == 222
        assert role.stream.last_seq == 4 and not role.degraded()
        assert role.counters.resets == 1  # local state flushed for the new process
        f.deliver(Op.HEARTBEAT, 60, Heartbeat(), 111)  # the old process: left for good
        assert role.stream.synced and stats.dropped.get("stale_incarnation") == 1
        f.deliver(Op.RELEASE, 5, Release("c"), 222)
        assert role.stream.last_seq == 5

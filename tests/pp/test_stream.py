"""The ordered stream over real Curve-authenticated pyzmq sockets on loopback:
in-order application, epochs, gaps, duplicates, reordering and resync."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from node_agent.metrics import AgentMetrics
from node_agent.pp.auth import CurveKeys
from node_agent.pp.channel import FanoutServer, FaultPlan, Sender
from node_agent.pp.messages import (
    Ack,
    Envelope,
    Kind,
    Op,
    Release,
    Reset,
    decode,
    encode,
    encode_sections,
    is_batch,
    pack,
    pack_batch,
    unpack_batch,
)
from node_agent.pp.stream import FollowerStream, LeaderStream, StreamMetrics
from tests.support.waiting import wait_for

GROUP = "g0"


def outside_coalescing_window(p: Pair) -> None:
    """Wait until the leader's next broadcast starts a burst of its own: nothing
    is queued and a whole coalescing window passed since its last broadcast."""
    lead = p.leader
    wait_for(lambda: not lead._outbox
             and time.monotonic() - lead._last_broadcast >= lead._window,
             "the leader's coalescing window to pass")


@dataclass
class Pair:
    leader: LeaderStream
    follower: FollowerStream
    applied: list[tuple[int, str]] = field(default_factory=list)
    unsynced: list[str] = field(default_factory=list)
    flushes: list[str] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    f_metrics: AgentMetrics = field(default_factory=AgentMetrics)
    lead_ep: str = ""
    keys: CurveKeys | None = None

    def dropped(self, reason: str) -> float:
        v = self.f_metrics.registry.get_sample_value(
            "flexkv_agent_fanout_dropped_total", {"group": GROUP, "reason": reason})
        return v or 0.0


@pytest.fixture
def pair() -> Iterator[Pair]:
    """One message per frame (batching off): faults hit single messages."""
    yield from _pair(coalesce_seconds=0.0)


@pytest.fixture
def batched_pair() -> Iterator[Pair]:
    """A wide coalescing window: a burst of broadcasts travels as batch frames."""
    yield from _pair(coalesce_seconds=0.05)


def _pair(coalesce_seconds: float) -> Iterator[Pair]:
    keys = CurveKeys.generate()
    lead_srv = FanoutServer("tcp://127.0.0.1:0", keys).start()
    f_metrics = AgentMetrics()
    f_stats = StreamMetrics(GROUP, f_metrics)
    fol_srv = FanoutServer("tcp://127.0.0.1:0", keys,
                           on_drop=lambda g, r: f_stats.drop(r)).start()
    holder: dict[str, Pair] = {}

    def flush(reason: str) -> None:
        holder["p"].flushes.append(reason)
        holder["p"].leader.broadcast(Op.RESET, Reset(reason))

    leader = LeaderStream(GROUP, 5, keys, StreamMetrics(GROUP, None), flush,
                          on_ack=lambda a: holder["p"].acks.append(a),
                          coalesce_seconds=coalesce_seconds, max_batch=16)
    follower = FollowerStream(
        GROUP, 1, keys, f_stats,
        apply=lambda m: holder["p"].applied.append((m.env.seq, m.env.op.name)),
        on_unsynced=lambda r: holder["p"].unsynced.append(r),
        on_dropped=lambda m: None,
        hello_interval=0.05,
    )
    p = Pair(leader, follower, f_metrics=f_metrics, lead_ep=lead_srv.endpoint, keys=keys)
    holder["p"] = p
    lead_srv.register(GROUP, leader.handle)
    fol_srv.register(GROUP, follower.handle)
    leader.set_followers({1: fol_srv.endpoint})
    follower.follow(5, lead_srv.endpoint)
    wait_for(lambda: leader.all_synced() and follower.synced,
             "leader.all_synced() and follower.synced")
    try:
        yield p
    finally:
        follower.close()
        leader.close()
        lead_srv.close()
        fol_srv.close()


def _send(p: Pair, n: int) -> list[int]:
    return [p.leader.broadcast(Op.RELEASE, Release(f"r{i}")) for i in range(n)]


def _seqs(p: Pair) -> list[int]:
    return [s for s, _ in p.applied]


def _hit(faults: FaultPlan) -> list[list[int]]:
    """The stream seqs of each frame a fault hit, in order ([] for a heartbeat):
    the leader's heartbeat thread may send at any moment, so tests assert on
    what a fault hit, not on when it fired."""
    out = []
    for _, frames in faults.log:
        data = frames[0]
        msgs = [decode([m]) for m in (unpack_batch(data) if is_batch(data) else [data])]
        out.append([m.env.seq for m in msgs if m.env.op.in_stream])
    return out


def _faults(p: Pair) -> FaultPlan:
    sender = p.leader.peer(1)
    assert sender is not None
    sender.faults = FaultPlan()
    return sender.faults


def test_messages_apply_in_order_and_acks_flow_back(pair: Pair) -> None:
    sent = _send(pair, 50)
    wait_for(lambda: len(pair.applied) == 50, "len(pair.applied) == 50")
    assert _seqs(pair) == sent == list(range(1, 51))
    assert pair.follower.send_ack(Ack(1, "r0", Kind.PUT, 0, 3, True), pair.leader.incarnation)
    wait_for(lambda: len(pair.acks) == 1, "len(pair.acks) == 1")
    assert pair.acks[0] == Ack(1, "r0", Kind.PUT, 0, 3, True)


def test_an_ack_for_another_leader_incarnation_is_dropped(pair: Pair) -> None:
    # A follower's ack of the previous leader process's decision reaches a new
    # leader process at the same address: it must never count as one of its own.
    assert pair.follower.incarnation == pair.leader.incarnation
    rogue = Sender(pair.lead_ep, pair.keys)
    try:
        stale = Ack(1, "r0", Kind.PUT, 0, 3, True)
        rogue.send(encode(Envelope(Op.ACK, GROUP, 5, 0,
                                   incarnation=pair.leader.incarnation + 1), stale))
        wait_for(lambda: pair.leader._stats.dropped.get("stale_incarnation") == 1,
                 "pair.leader._stats.dropped.get('stale_incarnation') == 1")
    finally:
        rogue.close()
    assert pair.acks == []
    assert pair.follower.send_ack(Ack(1, "r1", Kind.PUT, 1, 4, True),
                                  pair.leader.incarnation)  # its own stamp
    wait_for(lambda: len(pair.acks) == 1, "len(pair.acks) == 1")
    assert pair.acks[0].rid == "r1"


def test_duplicates_are_dropped_and_counted(pair: Pair) -> None:
    _faults(pair).duplicate(3)
    _send(pair, 5)
    wait_for(lambda: len(pair.applied) == 5 and pair.dropped("duplicate") == 3,
             "len(pair.applied) == 5 and pair.dropped('duplicate') == 3")
    assert _seqs(pair) == [1, 2, 3, 4, 5]
    assert pair.follower.synced


def test_dropped_message_makes_follower_resync_never_skip(pair: Pair) -> None:
    _send(pair, 2)
    wait_for(lambda: len(pair.applied) == 2, "len(pair.applied) == 2")
    pair.leader.dirty = True  # the group holds blocks: a resync must flush it
    _faults(pair).drop(1)
    _send(pair, 3)  # seq 3 is lost; 4 and 5 arrive after a gap
    wait_for(lambda: pair.flushes != [] and pair.follower.synced,
             "pair.flushes != [] and pair.follower.synced")
    applied = _seqs(pair)
    assert 3 not in applied and 4 not in applied and 5 not in applied
    assert applied == sorted(applied) and pair.dropped("gap") >= 1
    # After the resync the stream continues in order.
    more = _send(pair, 3)
    wait_for(lambda: _seqs(pair)[-1] == more[-1], "_seqs(pair)[-1] == more[-1]")
    assert _seqs(pair)[-3:] == more


def test_lost_tail_is_seen_through_heartbeats(pair: Pair) -> None:
    _faults(pair).drop(1)
    _send(pair, 1)  # the only message is lost; only a heartbeat reveals it
    wait_for(lambda: pair.dropped("gap") >= 1, "pair.dropped('gap') >= 1")
    assert 1 not in _seqs(pair)
    wait_for(lambda: pair.follower.synced, "pair.follower.synced")


def test_reordered_messages_are_never_applied_out_of_order(pair: Pair) -> None:
    _faults(pair).reorder()
    _send(pair, 4)  # arrives as 2, 1, 3, 4
    wait_for(lambda: pair.dropped("gap") >= 1 and pair.follower.synced,
             "pair.dropped('gap') >= 1 and pair.follower.synced")
    applied = _seqs(pair)
    assert applied == sorted(applied) and 2 not in applied
    assert len(applied) == len(set(applied))


def test_older_epoch_messages_are_dropped(pair: Pair) -> None:
    target = pair.leader.peer(1)
    assert target is not None
    rogue_leader = Sender(target.endpoint, pair.keys)
    try:
        frames = encode(Envelope(Op.RELEASE, GROUP, 4, pair.follower.last_seq + 1), Release("x"))
        rogue_leader.send(frames)
        wait_for(lambda: pair.dropped("stale_epoch") == 1, "pair.dropped('stale_epoch') == 1")
        assert pair.applied == []
    finally:
        rogue_leader.close()


def test_new_epoch_resyncs_and_fences_the_old_leader(pair: Pair) -> None:
    _send(pair, 2)
    wait_for(lambda: len(pair.applied) == 2, "len(pair.applied) == 2")
    # The follower moves to epoch 6 (a new leader); the old leader keeps sending.
    pair.follower.follow(6, pair.lead_ep)
    assert not pair.follower.synced and pair.unsynced
    _send(pair, 3)
    wait_for(lambda: pair.dropped("stale_epoch") >= 3, "pair.dropped('stale_epoch') >= 3")
    assert len(pair.applied) == 2


# -- batches: several stream messages in one frame ------------------------------------


def test_a_burst_travels_in_batches_and_applies_in_order(batched_pair: Pair) -> None:
    p = batched_pair
    sent = _send(p, 100)
    wait_for(lambda: len(p.applied) == 100, "len(p.applied) == 100")
    assert _seqs(p) == sent == list(range(1, 101))
    assert p.leader.batches >= 100 // 16 - 1  # full batches went out, not single frames


def test_a_lone_message_is_not_held_back(batched_pair: Pair) -> None:
    p = batched_pair
    outside_coalescing_window(p)  # nothing before coalesces with the next broadcast
    before = p.leader.batches
    _send(p, 1)
    wait_for(lambda: len(p.applied) == 1, "len(p.applied) == 1")
    assert p.leader.batches == before


def test_a_duplicated_batch_is_dropped_message_by_message(batched_pair: Pair) -> None:
    p = batched_pair
    _send(p, 1)  # sent alone; the next burst is queued behind it
    wait_for(lambda: len(p.applied) == 1, "len(p.applied) == 1")
    outside_coalescing_window(p)
    faults = _faults(p)
    faults.duplicate(2)
    _send(p, 6)  # seq 2 alone, then 3..7 as one batch; both frames arrive twice
    wait_for(lambda: len(p.applied) == 7 and len(faults.log) == 2,
             "len(p.applied) == 7 and len(faults.log) == 2")
    # Every stream message in a duplicated frame is dropped once as a duplicate.
    dups = sum(len(seqs) for seqs in _hit(faults))
    assert dups >= 1
    wait_for(lambda: p.dropped("duplicate") == dups, "p.dropped('duplicate') == dups")
    assert _seqs(p) == list(range(1, 8)) and p.follower.synced


def test_a_lost_batch_makes_the_follower_resync_never_skip(batched_pair: Pair) -> None:
    p = batched_pair
    _send(p, 2)
    wait_for(lambda: len(p.applied) == 2, "len(p.applied) == 2")
    p.leader.dirty = True
    outside_coalescing_window(p)
    faults = _faults(p)
    faults.drop(2)
    _send(p, 8)  # seq 3 alone and the batch 4..10 are lost
    wait_for(lambda: len(faults.log) == 2, "len(faults.log) == 2")
    lost = [s for seqs in _hit(faults) for s in seqs]
    assert lost  # (a heartbeat may take one of the two drops)
    wait_for(lambda: p.flushes != [] and p.follower.synced, "p.flushes != [] and p.follower.synced")
    applied = _seqs(p)
    # Applied up to the first lost message, never past it (the RESET of the
    # flush comes with a later seq).
    assert applied[:min(lost) - 1] == list(range(1, min(lost)))
    assert not set(lost) & set(applied) and p.dropped("gap") >= 1
    more = _send(p, 20)
    wait_for(lambda: _seqs(p)[-1] == more[-1], "_seqs(p)[-1] == more[-1]")
    assert _seqs(p)[-20:] == more


def test_reordered_batches_are_never_applied_out_of_order(batched_pair: Pair) -> None:
    p = batched_pair
    outside_coalescing_window(p)
    faults = _faults(p)
    faults.reorder()
    _send(p, 40)  # seq 1 alone is held and arrives after the first batch
    wait_for(lambda: len(faults.log) == 1, "len(faults.log) == 1")
    [held] = _hit(faults)
    if held:  # a stream frame was held (not a heartbeat): the follower saw a gap
        wait_for(lambda: p.dropped("gap") >= 1 and p.follower.synced,
                 "p.dropped('gap') >= 1 and p.follower.synced")
    else:
        wait_for(lambda: len(p.applied) == 40, "len(p.applied) == 40")
    applied = _seqs(p)
    assert applied == sorted(applied) and not set(held) & set(applied)
    assert len(applied) == len(set(applied))


def test_a_malformed_message_inside_a_batch_is_dropped_and_counted(pair: Pair) -> None:
    target = pair.leader.peer(1)
    assert target is not None
    seq = pair.follower.last_seq
    inc = pair.leader.incarnation  # as if the leader had sent them
    good = [encode(Envelope(Op.RELEASE, GROUP, 5, seq + i, incarnation=inc),
                   Release(f"x{i}"))[0] for i in (1, 2)]
    bad = good[1][:-3]
    rogue = Sender(target.endpoint, pair.keys)
    try:
        rogue.send([pack_batch([good[0], bad])])
        wait_for(lambda: pair.dropped("malformed") == 1 and len(pair.applied) == 1,
                 "pair.dropped('malformed') == 1 and len(pair.applied) == 1")
        rogue.send([pack_batch([good[1]])[:-1]])  # a truncated batch frame
        wait_for(lambda: pair.dropped("malformed") == 2, "pair.dropped('malformed') == 2")
    finally:
        rogue.close()
    assert _seqs(pair) == [seq + 1]


def test_a_body_that_fails_its_type_check_and_is_truncated_leaves_the_receiver_running(
        pair: Pair) -> None:
    """A body whose first field has the wrong type and whose data ends early is
    dropped as malformed, alone and in a batch; later messages are still applied."""
    target = pair.leader.peer(1)
    assert target is not None
    seq = pair.follower.last_seq
    inc = pair.leader.incarnation
    good = [encode(Envelope(Op.RELEASE, GROUP, 5, seq + i, incarnation=inc),
                   Release(f"x{i}"))[0] for i in (1, 2)]
    sections = encode_sections(Envelope(Op.RELEASE, GROUP, 5, seq + 1, incarnation=inc),
                               Release("x1"))
    bad = pack([sections[0], sections[1], b"\x92\x05"])  # [5, <truncated>]
    rogue = Sender(target.endpoint, pair.keys)
    try:
        rogue.send([bad])
        wait_for(lambda: pair.dropped("malformed") == 1, "pair.dropped('malformed') == 1")
        rogue.send([pack_batch([bad, good[0]])])
        wait_for(lambda: pair.dropped("malformed") == 2 and len(pair.applied) == 1,
                 "pair.dropped('malformed') == 2 and len(pair.applied) == 1")
        rogue.send([good[1]])
        wait_for(lambda: len(pair.applied) == 2, "len(pair.applied) == 2")
    finally:
        rogue.close()
    assert _seqs(pair) == [seq + 1, seq + 2]



def test_broadcast_builds_the_body_only_for_synced_followers() -> None:
    """Before its follower is synced, a message takes its seq but is neither
    built nor sent; the follower, once synced, continues strictly after those
    seqs, and a message broadcast then is built once and applied."""
    built: list[str] = []
    applied: list[tuple[int, str]] = []

    def body(rid: str) -> Callable[[], Release]:
        def build() -> Release:
            built.append(rid)
            return Release(rid)
        return build

    keys = CurveKeys.generate()
    lead_srv = FanoutServer("tcp://127.0.0.1:0", keys).start()
    fol_srv = FanoutServer("tcp://127.0.0.1:0", keys).start()
    leader = LeaderStream(GROUP, 5, keys, StreamMetrics(GROUP, None), lambda r: None,
                          on_ack=lambda a: None, coalesce_seconds=0.0)
    follower = FollowerStream(GROUP, 1, keys, StreamMetrics(GROUP, None),
                              apply=lambda m: applied.append((m.env.seq, m.env.op.name)),
                              on_unsynced=lambda r: None, on_dropped=lambda m: None,
                              hello_interval=0.05)
    try:
        lead_srv.register(GROUP, leader.handle)
        fol_srv.register(GROUP, follower.handle)
        leader.set_followers({1: fol_srv.endpoint})  # known, not synced yet
        assert [leader.broadcast(Op.RELEASE, body(f"early{i}")) for i in range(2)] == [1, 2]
        assert built == []
        follower.follow(5, lead_srv.endpoint)
        wait_for(lambda: leader.all_synced() and follower.synced,
                 "leader.all_synced() and follower.synced")
        assert leader.broadcast(Op.RELEASE, body("late")) == 3
        wait_for(lambda: bool(applied), "bool(applied)")
        assert built == ["late"] and applied == [(3, "RELEASE")]
    finally:
        follower.close()
        leader.close()
        lead_srv.close()
        fol_srv.close()

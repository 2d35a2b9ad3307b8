"""One follower role driven message by message, with a stand-in sender that
keeps its acks: call orders around a leader restart or a resync.

* A follower stamps every ACK with the incarnation of the leader process whose
  decision it answers (docs/invariants.md, invariant 9): a leader restarted
  under the same epoch, whose rid, ``n`` and task id may equal its
  predecessor's, never counts an ack of a decision it did not make.
* A store this stage answered with a task id is reported by
  ``poll_completed`` even when a resync skipped the message that ends it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from node_agent.backend.stage_store import TierStore
from node_agent.coordinator import CoordinatorConfig
from node_agent.coordinator.follower import FollowerRole
from node_agent.coordinator.inputs import prepare_lookup, prepare_store
from node_agent.pp.messages import (
    Decision,
    Envelope,
    Heartbeat,
    Message,
    Op,
    Release,
    Sync,
    decode,
)
from node_agent.pp.stream import StreamMetrics
from node_agent.vocab.placement import Direction

from .harness import GROUP, LAYOUT, NUM_SLOTS, backend_config, make_buffers

TPB = LAYOUT.tokens_per_block


class _Capture:
    """Stands in for the follower's sender: keeps every ACK it sends."""

    endpoint = "inproc://capture"

    def __init__(self) -> None:
        self.acks: list[Message] = []

    def send(self, frames: list[bytes]) -> bool:
        msg = decode(frames)
        if msg.env.op is Op.ACK:
            self.acks.append(msg)
        return True

    def close(self) -> None:
        pass


def test_a_load_ack_of_the_old_leaders_decision_is_never_stamped_with_the_new_leader() -> None:
    cfg = CoordinatorConfig(group=GROUP, pp_rank=1, layout=LAYOUT, engine_call_seconds=2.0,
                          fanout_wait_seconds=0.5, transfer_seconds=0.4)
    store_ = TierStore(backend_config(8, True))
    store_.register_kv_buffers(0, make_buffers())
    role = FollowerRole(cfg, 1, None, store_, None, StreamMetrics(GROUP, None), NUM_SLOTS)
    copying, finish = threading.Event(), threading.Event()

    def slow_execute(*_: Any, **__: Any) -> None:
        copying.set()
        finish.wait(10)

    store_.execute = slow_execute  # type: ignore[method-assign]
    capture = _Capture()
    try:
        role.start()
        role.stream._sender = capture  # type: ignore[assignment]

        def deliver(op: Op, seq: int, inc: int, body: object) -> None:
            role.handle(Message(Envelope(op, GROUP, 1, seq, incarnation=inc), body))  # type: ignore[arg-type]

        deliver(Op.SYNC, 10, 111, Sync(1, 1))
        tokens = np.arange(50, 50 + TPB)
        inp = prepare_lookup(tokens, None, TPB)
        deliver(Op.GET, 11, 111, Decision(Direction.LOAD, "r", 0, 0, np.ones(TPB, bool),
                                          np.array([[0, 0, 1]], np.int64), None, inp.digest))
        assert role.lookup("r", inp) == TPB
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(role.retrieve("r", np.arange(TPB))))
        t.start()
        assert copying.wait(5)
        # Leader 111 is replaced by 222 under the same epoch while the load runs;
        # 222's first decision may well be ("r", GET, n=0, task 0) too.
        deliver(Op.HEARTBEAT, 0, 222, Heartbeat())
        deliver(Op.SYNC, 0, 222, Sync(1, 2))
        assert role.stream.incarnation == 222
        finish.set()
        t.join(10)
        assert out == [0]
        acks = [(m.env.incarnation, m.body.ok) for m in capture.acks]  # type: ignore[union-attr]
        assert acks and all(inc == 111 for inc, _ in acks), acks
    finally:
        finish.set()
        role.close()
        store_.close()


def test_a_store_whose_result_a_resync_skipped_is_still_reported_complete() -> None:
    cfg = CoordinatorConfig(group=GROUP, pp_rank=1, layout=LAYOUT, engine_call_seconds=2.0,
                          fanout_wait_seconds=0.5, transfer_seconds=0.4)
    store_ = TierStore(backend_config(8, True))
    store_.register_kv_buffers(0, make_buffers())
    role = FollowerRole(cfg, 1, None, store_, None, StreamMetrics(GROUP, None), NUM_SLOTS)
    store_.execute = lambda *_, **__: None  # type: ignore[method-assign]
    capture = _Capture()
    try:
        role.start()
        role.stream._sender = capture  # type: ignore[assignment]

        def deliver(op: Op, seq: int, body: object) -> None:
            role.handle(Message(Envelope(op, GROUP, 1, seq, incarnation=111), body))  # type: ignore[arg-type]

        deliver(Op.SYNC, 10, Sync(1, 1))
        tokens = np.arange(50, 50 + TPB)
        inp = prepare_store(tokens, np.arange(TPB), TPB, NUM_SLOTS)
        deliver(Op.PUT, 11, Decision(Direction.STORE, "r", 0, 7, np.ones(TPB, bool),
                                     np.array([[0, 0, 1]], np.int64), None, inp.digest))
        assert role.store_kv("r", inp) == 7  # the engine now waits for "r" to complete
        # The leader's RESULT for it is lost (a gap): the stage resyncs. The
        # leader flushes a dirty group before its SYNC, but the RESET goes only
        # to synced followers, so this stage never sees it.
        deliver(Op.HEARTBEAT, 13, Heartbeat())
        assert not role.stream.synced
        deliver(Op.SYNC, 14, Sync(1, 2))
        assert role.stream.synced
        assert role.poll_completed() == ["r"]
    finally:
        role.close()
        store_.close()


def test_a_new_leader_process_keeps_a_lagging_life_behind_its_first_decisions() -> None:
    cfg = CoordinatorConfig(group=GROUP, pp_rank=1, layout=LAYOUT, engine_call_seconds=2.0,
                          fanout_wait_seconds=0.5, transfer_seconds=0.4)
    store_ = TierStore(backend_config(8, True))
    store_.register_kv_buffers(0, make_buffers())
    role = FollowerRole(cfg, 1, None, store_, None, StreamMetrics(GROUP, None), NUM_SLOTS)
    store_.execute = lambda *_, **__: None  # type: ignore[method-assign]
    capture = _Capture()
    try:
        role.start()
        role.stream._sender = capture  # type: ignore[assignment]

        def deliver(op: Op, seq: int, inc: int, body: object) -> None:
            role.handle(Message(Envelope(op, GROUP, 1, seq, incarnation=inc), body))  # type: ignore[arg-type]

        deliver(Op.SYNC, 10, 111, Sync(1, 1))
        # Leader 111's engine released "r"; this stage's engine has not yet.
        deliver(Op.RELEASE, 11, 111, Release("r", 1))
        # Leader 111 is replaced by 222 (it numbers lives from 0), whose engine is
        # in the rid's next life and stores the same tokens again.
        deliver(Op.HEARTBEAT, 0, 222, Heartbeat())
        deliver(Op.SYNC, 0, 222, Sync(1, 2))
        inp = prepare_store(np.arange(50, 50 + TPB), np.arange(TPB), TPB, NUM_SLOTS)
        deliver(Op.PUT, 1, 222, Decision(Direction.STORE, "r", 0, 9, np.ones(TPB, bool),
                                         np.array([[0, 0, 1]], np.int64), None, inp.digest,
                                         life=0))
        # This stage's call of the rid's earlier life never takes it.
        assert role.store_kv("r", inp) == -1
        role.release("r")
        assert role.store_kv("r", inp) == 9
    finally:
        role.close()
        store_.close()

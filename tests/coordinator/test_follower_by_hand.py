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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from node_agent.coordinator.inputs import prepare_lookup, prepare_store
from node_agent.pp.messages import (
    Decision,
    Heartbeat,
    Message,
    Op,
    Release,
    Sync,
    decode,
)
from node_agent.vocab.placement import Direction
from tests.coordinator.harness import (
    LAYOUT,
    NUM_SLOTS,
    HandFedFollower,
)

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


@contextmanager
def captured(execute: Callable[..., None]) -> Iterator[tuple[HandFedFollower, _Capture]]:
    """A started hand-fed follower whose copies run ``execute`` and whose acks are
    captured."""
    with HandFedFollower() as f:
        f.store.execute = execute  # type: ignore[method-assign]
        capture = _Capture()
        f.role.stream._sender = capture  # type: ignore[assignment]
        yield f, capture


def _no_copy(*_: Any, **__: Any) -> None:
    pass


def test_a_load_ack_of_the_old_leaders_decision_is_never_stamped_with_the_new_leader() -> None:
    copying, finish = threading.Event(), threading.Event()

    def slow_execute(*_: Any, **__: Any) -> None:
        copying.set()
        finish.wait(10)

    with captured(slow_execute) as (f, capture):
        try:
            role = f.role
            f.deliver(Op.SYNC, 10, Sync(1, 1), 111)
            tokens = np.arange(50, 50 + TPB)
            inp = prepare_lookup(tokens, None, TPB)
            f.deliver(Op.GET, 11, Decision(Direction.LOAD, "r", 0, 0, np.ones(TPB, bool),
                                           np.array([[0, 0, 1]], np.int64), None, inp.digest),
                      111)
            assert role.lookup("r", inp) == TPB
            out: list[int] = []
            t = threading.Thread(target=lambda: out.append(role.retrieve("r", np.arange(TPB))))
            t.start()
            assert copying.wait(5)
            # Leader 111 is replaced by 222 under the same epoch while the load runs;
            # 222's first decision may well be ("r", GET, n=0, task 0) too.
            f.deliver(Op.HEARTBEAT, 0, Heartbeat(), 222)
            f.deliver(Op.SYNC, 0, Sync(1, 2), 222)
            assert role.stream.incarnation == 222
            finish.set()
            t.join(10)
            assert out == [0]
            acks = [(m.env.incarnation, m.body.ok) for m in capture.acks]  # type: ignore[union-attr]
            assert acks and all(inc == 111 for inc, _ in acks), acks
        finally:
            finish.set()


def test_a_store_whose_result_a_resync_skipped_is_still_reported_complete() -> None:
    with captured(_no_copy) as (f, _):
        role = f.role
        f.deliver(Op.SYNC, 10, Sync(1, 1), 111)
        tokens = np.arange(50, 50 + TPB)
        inp = prepare_store(tokens, np.arange(TPB), TPB, NUM_SLOTS)
        f.deliver(Op.PUT, 11, Decision(Direction.STORE, "r", 0, 7, np.ones(TPB, bool),
                                       np.array([[0, 0, 1]], np.int64), None, inp.digest), 111)
        assert role.store_kv("r", inp) == 7  # the engine now waits for "r" to complete
        # The leader's RESULT for it is lost (a gap): the stage resyncs. The
        # leader flushes a dirty group before its SYNC, but the RESET goes only
        # to synced followers, so this stage never sees it.
        f.deliver(Op.HEARTBEAT, 13, Heartbeat(), 111)
        assert not role.stream.synced
        f.deliver(Op.SYNC, 14, Sync(1, 2), 111)
        assert role.stream.synced
        assert role.poll_completed() == ["r"]


def test_a_new_leader_process_keeps_a_lagging_life_behind_its_first_decisions() -> None:
    with captured(_no_copy) as (f, _):
        role = f.role
        f.deliver(Op.SYNC, 10, Sync(1, 1), 111)
        # Leader 111's engine released "r"; this stage's engine has not yet.
        f.deliver(Op.RELEASE, 11, Release("r", 1), 111)
        # Leader 111 is replaced by 222 (it numbers lives from 0), whose engine is
        # in the rid's next life and stores the same tokens again.
        f.deliver(Op.HEARTBEAT, 0, Heartbeat(), 222)
        f.deliver(Op.SYNC, 0, Sync(1, 2), 222)
        inp = prepare_store(np.arange(50, 50 + TPB), np.arange(TPB), TPB, NUM_SLOTS)
        f.deliver(Op.PUT, 1, Decision(Direction.STORE, "r", 0, 9, np.ones(TPB, bool),
                                      np.array([[0, 0, 1]], np.int64), None, inp.digest,
                                      life=0), 222)
        # This stage's call of the rid's earlier life never takes it.
        assert role.store_kv("r", inp) == -1
        role.release("r")
        assert role.store_kv("r", inp) == 9

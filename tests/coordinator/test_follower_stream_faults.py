"""A follower role driven message by message in stream order, with a real
TierStore: failed MOVES resync, decisions made stale by a RESET, rejected
inputs keeping the call pairing, and retrieve after a missed lookup."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from node_agent.coordinator import UnknownRequestError
from node_agent.coordinator.inputs import prepare_lookup, prepare_store, token_digest
from node_agent.pp.messages import (
    Decision,
    Kind,
    Moves,
    Op,
    Release,
    Reset,
    Sync,
)
from node_agent.vocab.placement import BlockLocation, Direction, Tier, TierMove, TransferPlan
from tests.coordinator.harness import (
    LAYOUT,
    NUM_SLOTS,
    HandFedFollower,
)
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block


class Driven(HandFedFollower):
    """A synced hand-fed follower: ``send`` delivers the next in-order message."""

    def __enter__(self) -> Driven:
        super().__enter__()
        self.seq = 10
        self.deliver(Op.SYNC, self.seq, Sync(1, 1))
        assert self.role.stream.synced, "the follower must sync on the SYNC answer"
        return self

    def send(self, op: Op, body: object) -> None:
        self.seq += 1
        self.deliver(op, self.seq, body)

    def put_decision(self, rid: str, n: int, task_id: int, blocks: int, base: int = 0,
                     life: int = 0) -> None:
        """The leader's put decision for tokens ``base .. base + blocks * TPB``, in
        the leader's life ``life`` of ``rid``."""
        plan = TransferPlan(Direction.STORE,
                            tuple(BlockLocation(Tier.CPU, i) for i in range(blocks)))
        digest = token_digest(np.arange(base, base + blocks * TPB))
        self.send(Op.PUT, Decision.build(Direction.STORE, rid, n, task_id,
                                         np.ones(blocks * TPB, bool), plan, digest=digest,
                                         life=life))


@pytest.fixture
def driven() -> Iterator[Driven]:
    with Driven() as d:
        yield d


def _input(blocks: int, base: int = 0) -> object:
    return prepare_store(np.arange(base, base + blocks * TPB), np.arange(blocks * TPB), TPB,
                         NUM_SLOTS)


def test_failed_moves_make_the_follower_resync_not_stay_synced(
        driven: Driven, caplog: pytest.LogCaptureFixture) -> None:
    bad = TierMove(BlockLocation(Tier.CPU, 10_000), BlockLocation(Tier.CPU, 0))
    with caplog.at_level(logging.WARNING):
        driven.send(Op.MOVES, Moves((bad,)))
    assert not driven.role.stream.synced
    assert driven.role.degraded()
    assert driven.role.counters.moves_applied == 0
    assert any("moves" in r.getMessage().lower() for r in caplog.records)


def test_put_decided_before_a_reset_is_refused_and_reported(driven: Driven) -> None:
    driven.put_decision("a", 0, task_id=5, blocks=2)
    take = driven.role._book.take

    def take_then_reset(rid: str, kind: Kind, digest: int, timeout: float) -> object:
        # The interleaving under test: the engine thread took the decision, then
        # the server thread applies the leader's RESET before the copy starts.
        got = take(rid, kind, digest, timeout)
        driven.send(Op.RESET, Reset("engine reset"))
        return got

    driven.role._book.take = take_then_reset  # type: ignore[method-assign,assignment]
    assert driven.role.store_kv("a", _input(2)) == -1  # type: ignore[arg-type]
    assert driven.role.counters.stores_executed == 0
    assert driven.role.counters.store_failures == 1
    assert driven.role.poll_completed() == ["a"]


def test_put_decided_after_a_reset_executes(driven: Driven) -> None:
    driven.send(Op.RESET, Reset("engine reset"))
    driven.put_decision("a", 0, task_id=6, blocks=2)
    assert driven.role.store_kv("a", _input(2)) == 6  # type: ignore[arg-type]
    assert driven.role.counters.stores_executed == 1


def test_a_decision_for_a_call_this_stage_never_made_is_skipped(driven: Driven) -> None:
    # This stage rejected its call for tokens 500.. (nothing reached the role);
    # the leader decided it. The next call (tokens 0..) takes its own decision.
    driven.put_decision("r", 0, task_id=8, blocks=1, base=500)
    driven.put_decision("r", 1, task_id=9, blocks=1)
    assert driven.role.store_kv("r", _input(1)) == 9  # type: ignore[arg-type]
    assert driven.role.counters.decisions_unpaired == 1
    assert driven.role.counters.mismatches == 0


def test_retrieve_after_a_missed_lookup_is_a_miss_once(driven: Driven) -> None:
    inp = prepare_lookup(np.arange(2 * TPB), None, TPB)
    driven.send(Op.GET, Decision.build(Direction.LOAD, "m", 0, -1, np.zeros(2 * TPB, bool),
                                       None, digest=inp.digest))
    assert driven.role.lookup("m", inp) == 0
    assert driven.role.retrieve("m", np.zeros(0, np.int64)) == 0
    with pytest.raises(UnknownRequestError):
        driven.role.retrieve("m", np.zeros(0, np.int64))
    with pytest.raises(UnknownRequestError):
        driven.role.retrieve("never-looked-up", np.zeros(0, np.int64))


def test_a_call_ahead_of_the_leaders_release_still_takes_its_decision(driven: Driven) -> None:
    # This stage released "r" and calls again before the leader's RELEASE
    # arrives: the RELEASE must not end the life the waiting call belongs to.
    driven.role.release("r")
    answers: list[int] = []
    caller = threading.Thread(target=lambda: answers.append(
        driven.role.store_kv("r", _input(1))))  # type: ignore[arg-type]
    caller.start()
    wait_for(lambda: "r" in driven.role._book._rids
             and driven.role._book._rids["r"].waiters == 1, "the call waiting")
    driven.send(Op.RELEASE, Release("r", 1))
    driven.put_decision("r", 0, task_id=7, blocks=1, life=1)
    caller.join(10)
    assert answers == [7]

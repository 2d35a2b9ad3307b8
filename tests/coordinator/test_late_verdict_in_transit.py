"""A load verdict delayed in transit past the follower's verdict wait (docs/pp.md,
"Loads"): the leader sent its ok verdict in time by its own clock (its lateness
check passed), the message then sat in transit until the follower gave up and
answered 0. One more message cannot close this (it could be late too); the
follower refuses the late verdict and counts the disagreement
(``late_load_verdicts``) so it is visible. Two connectors in one process, real
fan-out sockets on loopback; the RESULT is held on the leader's sender until the
follower answered (deterministic, no timing asserted)."""

from __future__ import annotations

import threading

import numpy as np

from node_agent.pp.channel import FaultPlan
from node_agent.pp.messages import Op, decode, is_batch, unpack_batch
from tests.coordinator.harness import LAYOUT
from tests.coordinator.pairs import InProcessGroup

TPB = LAYOUT.tokens_per_block
TOKENS = np.arange(100, 100 + 2 * TPB)
TIMEOUTS = {"engine_call_seconds": 4.0, "fanout_wait_seconds": 1.2, "transfer_seconds": 0.6}


class HoldResults(FaultPlan):
    """Holds each frame carrying a RESULT until ``release`` is set (in transit)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.held = threading.Event()

    def mangle(self, frames: list[bytes]) -> list[list[bytes]]:
        data = frames[0]
        msgs = unpack_batch(data) if is_batch(data) else [data]
        if any(decode([m]).env.op is Op.RESULT for m in msgs):
            self.held.set()
            assert self.release.wait(60), "the test never released the RESULT"
        return [frames]


def test_an_ok_verdict_late_in_transit_is_refused_and_counted() -> None:
    with InProcessGroup(2, **TIMEOUTS) as g:
        g.store_everywhere("s", TOKENS)
        assert g.lookup_everywhere("q", TOKENS) == [len(TOKENS), len(TOKENS)]
        follower = g.follower(1)
        sender = g.conns[0]._role.stream.peer(1)  # type: ignore[union-attr]
        assert sender is not None
        plan = HoldResults()
        sender.faults = plan
        dst = np.arange(300, 300 + len(TOKENS))
        leader_call = g.retrieve(0, "q", dst)  # waits for the follower's ack first
        follower_call = g.retrieve(1, "q", dst)
        try:
            assert follower_call.result(30) == 0  # its verdict wait ran out
            assert plan.held.is_set(), "the leader sent no verdict before the follower gave up"
        finally:
            plan.release.set()
            sender.faults = None
        leader = leader_call.result(30)
        g.caught_up(1)
        assert follower.counters.late_load_verdicts == 1
        assert g.conns[1].status()["counters"]["late_load_verdicts"] == 1
        # What remains (docs/pp.md): the leader answered the hit by its own clock.
        assert leader == len(TOKENS)

"""A follower's engine call never copies to or from buffers its engine
registered after the call began.

An engine that dies while its follower stage's ``store_kv`` waits for the
leader's decision, and is restarted (new buffers, registered again) before that
decision arrives, leaves a call whose slots name the old engine's KV. Copying
them from the new buffers would store the new engine's bytes under the old
request's tokens, published for the whole group once every stage acked. Two
connectors in one process, real fan-out sockets on loopback, each stage's
engine calls on its own thread; the call order is forced, no timing asserted.
"""

from __future__ import annotations

import numpy as np

from node_agent.coordinator.follower import FollowerRole
from tests.coordinator.harness import LAYOUT, make_buffers, write_slots
from tests.coordinator.pairs import InProcessGroup
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block
TOKENS = np.arange(100, 100 + 2 * TPB)


def test_a_store_call_made_before_a_re_registration_is_refused() -> None:
    with InProcessGroup(2, engine_call_seconds=20.0, fanout_wait_seconds=9.0,
                        transfer_seconds=2.0) as g:
        frole = g.conns[1]._role
        assert isinstance(frole, FollowerRole)
        # The follower's engine stores first: its call waits for the decision.
        pending = g.store(1, "r", TOKENS, np.arange(100, 100 + len(TOKENS)))
        wait_for(lambda: "r" in frole._book._rids and frole._book._rids["r"].waiters > 0,
                 "the follower's store waiting for its decision", 10)
        # Its engine restarts: new buffers (other bytes in the same slots).
        fresh = make_buffers()
        write_slots(fresh, np.arange(100, 100 + len(TOKENS)),
                    np.full((len(TOKENS), LAYOUT.num_planes, LAYOUT.row_elems), 5.0,
                            np.float32))
        g.conns[1].register_kv_buffers(0, fresh)
        g.bufs[1] = fresh
        task = g.store(0, "r", TOKENS, np.arange(0, len(TOKENS))).result(30)
        assert task >= 0
        assert pending.result(30) == -1
        g.settle()
        counters = g.conns[0].status()["counters"]
        assert counters["stores_published"] == 0 and counters["stores_discarded"] == 1
        # Nothing of it is served; load_everywhere checks every loaded byte.
        assert g.load_everywhere("q", TOKENS) == [0, 0]
        # The restarted engine's own stores work as before.
        g.store_everywhere("s", TOKENS, base=200)
        assert g.load_everywhere("q2", TOKENS, base_slot=400) == [len(TOKENS)] * 2

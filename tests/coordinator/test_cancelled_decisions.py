"""A decision the leader ended is never applied, whatever life it waits for.

A follower that lags behind its leader holds the leader's decisions of a rid's
later life until its own engine reaches that life. When the leader ends such a
decision first (a store its followers did not ack in time, discarded; a lookup
it cancelled), the decision's blocks go back to the leader's free list and a
later store may take them: the lagging call must then get nothing (-1 / a miss),
never copy into those blocks, even after the stage's own release of the rid.
Two connectors in one process, real fan-out sockets on loopback.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.coordinator.harness import LAYOUT
from tests.coordinator.pairs import InProcessGroup
from tests.support.waiting import wait_for

TPB = LAYOUT.tokens_per_block
A = np.arange(100, 100 + 2 * TPB)
B = np.arange(300, 300 + 2 * TPB)
C = np.arange(500, 500 + 2 * TPB)


# Four CPU blocks: two hold A; B's discarded blocks are the only free ones, so
# C's store takes them.
pytestmark = pytest.mark.pair_options(cpu_blocks=4)


def _slots(base: int) -> np.ndarray:
    return np.arange(base, base + 2 * TPB)


def test_a_lagging_store_never_copies_into_blocks_of_a_store_the_leader_discarded(
        pair: InProcessGroup) -> None:
    pair.store_everywhere("r", A)
    # The leader's engine runs ahead: it releases the rid and stores B in the
    # rid's next life. Stage 1 has not reached that life: the decision waits
    # for it, unacked, until the leader discards the store.
    pair.call(0, lambda c: c.release("r")).result(30)
    assert pair.store(0, "r", B, _slots(32)).result(30) >= 0
    wait_for(lambda: pair.conns[0].status()["counters"]["stores_discarded"] == 1,
             "the leader discarded the unacked store", 30)
    pair.caught_up(1)
    # C takes the blocks B's discarded store had.
    pair.store_everywhere("c", C, 64)
    # Stage 1 reaches the rid's next life: the decision for its B was ended.
    pair.call(1, lambda c: c.release("r")).result(30)
    assert pair.store(1, "r", B, _slots(96)).result(30) == -1
    assert pair.conns[1].status()["counters"]["stores_executed"] == 2
    # C is intact on every stage.
    assert pair.load_everywhere("q", C) == [len(C), len(C)]


def test_a_lagging_lookup_whose_load_the_leader_cancelled_answers_a_miss_at_once(
        pair: InProcessGroup) -> None:
    pair.store_everywhere("s", A)
    # The leader's engine looks A up and releases the rid without loading it:
    # the leader cancels the load before stage 1 made its lookup.
    assert pair.call(0, lambda c: c.lookup("r", A)).result(30) == len(A)
    pair.call(0, lambda c: c.release("r")).result(30)
    pair.caught_up(1)
    assert pair.call(1, lambda c: c.lookup("r", A)).result(30) == 0
    assert pair.retrieve(1, "r", _slots(96)).result(30) == 0
    counters = pair.conns[1].status()["counters"]
    assert (counters["decision_timeouts"], counters["mismatches"]) == (0, 0)
    pair.call(1, lambda c: c.release("r")).result(30)
    assert pair.load_everywhere("q", A) == [len(A), len(A)]

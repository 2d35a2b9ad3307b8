"""The demo engine never reuses the source slots of a store the agent has not
reported complete: they stay quarantined until ``poll_completed`` names the
request, and the run fails with a clear message when no free slots are left."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from node_agent.demo.engine import DemoEngine
from node_agent.demo.workload import DemoRequest
from tests.agent.harness import LAYOUT


class SlowStoreAgent:
    """Stands in for the agent at the engine socket: every lookup misses, every
    store is accepted, and a store completes only when the test says so."""

    def __init__(self) -> None:
        self.completed: list[str] = []
        self.stores: list[tuple[str, list[int]]] = []

    def lookup(self, rid: str, tokens: Any) -> int:
        return 0

    def store_kv(self, rid: str, tokens: Any, slots: Any) -> int:
        self.stores.append((rid, np.asarray(slots).tolist()))
        return len(self.stores)

    def poll_completed(self) -> list[str]:
        done, self.completed = self.completed, []
        return done

    def release(self, rid: str) -> None:
        return None

    def close(self) -> None:
        return None


@pytest.fixture()
def engine() -> Iterator[tuple[DemoEngine, SlowStoreAgent]]:
    agent = SlowStoreAgent()
    eng = DemoEngine(agent, LAYOUT, num_slots=16, store_wait=0.05)  # type: ignore[arg-type]
    yield eng, agent
    eng.close()


def _req(rid: str, n: int) -> DemoRequest:
    toks = np.arange(n, dtype=np.int64)
    return DemoRequest(rid=rid, conversation=0, turn=0, prompt=toks[: n // 2],
                       reply=toks[n // 2:])


def test_timed_out_store_slots_are_never_reused(engine: tuple[DemoEngine, SlowStoreAgent]
                                               ) -> None:
    eng, agent = engine
    eng.serve(_req("a", 8))          # never completes: slots 0..7 quarantined
    assert eng.counts["store_timeouts"] == 1
    agent.completed.append("b")      # b completes in time
    eng.serve(_req("b", 8))
    agent.completed.append("c")
    eng.serve(_req("c", 8))          # wraps around: must skip a's slots
    used = dict(agent.stores)
    assert set(used["a"]).isdisjoint(used["b"]) and set(used["a"]).isdisjoint(used["c"])
    with pytest.raises(RuntimeError, match=r"quarantined by stores .* \(a\)"):
        eng.serve(_req("d", 12))
    # The late completion of a frees its slots again.
    agent.completed.append("a")
    agent.completed.append("e")
    eng.serve(_req("e", 12))
    assert eng.counts["store_timeouts"] == 1
    assert not eng._blocked.any()

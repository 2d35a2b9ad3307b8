"""Which claim a commit ends, through a real agent: a claim is named by its id, so
a commit of an older claim of a rid answers a miss and leaves the rid's live claim
pinned; a lookup of the rid that lands while its claim is being made ends that
claim (the claim answers a miss); claims ended by releases never push a live
claim out of the agent's records; an agent that no longer knows a claim (it
restarted) makes ``EngineLoads`` answer a miss rather than raise; and the
``flexkv_agent_engine_loads_total`` outcomes say how each claim ended."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from node_agent.backend.embedded import EmbeddedBackend
from node_agent.client import EngineAPIError
from tests.agent.test_engine_loads import (
    PROMPT,
    SRC,
    _backend,
    _locked,
    equal_slots,
    solo,
    zero_slots,
)

pytestmark = pytest.mark.timeout(180)


async def test_a_commit_naming_an_older_claim_leaves_the_live_claim_alone(
        work: Path) -> None:
    async with solo(work) as e:
        client, backend = e.client, _backend(e.ra)
        assert await asyncio.to_thread(client.lookup, "r", PROMPT) == 32
        first = await asyncio.to_thread(client.claim_load, "r")
        assert first is not None and first["claim"] >= 0
        # A new lookup of the rid ends the first claim; the second is a new one.
        assert await asyncio.to_thread(client.lookup, "r", PROMPT) == 32
        second = await asyncio.to_thread(client.claim_load, "r")
        assert second is not None and second["claim"] != first["claim"]
        # The lookup ended the first claim early: the claim fence moved before its
        # blocks unpinned, so an engine still copying them asks before trusting it.
        assert second["fence"] == first["fence"] + 1 == backend.store.cpu.fence_value()
        # The first claim's (late) commit is a miss and does not end the second.
        assert await asyncio.to_thread(client.commit_load, "r", first["claim"]) is False
        assert _locked(backend) == 8
        # Claim ids are the agent's own, not the backend's task ids (which start
        # again at 1 in a new backend): a commit naming the task is an older claim.
        [stage] = e.ra.agent.service.stages.values()
        [(_, task, claim)] = stage.coordinator._claims.values()
        assert claim == second["claim"] != task
        assert await asyncio.to_thread(client.commit_load, "r", task) is False
        assert _locked(backend) == 8
        assert await asyncio.to_thread(client.commit_load, "r", second["claim"]) is True
        assert _locked(backend) == 0


async def test_a_lookup_landing_during_a_claim_ends_that_claim(work: Path) -> None:
    """The claim is being made (inside the backend's claim_rows) when a second
    lookup of the same rid arrives (on another thread: a stage whose calls run on
    the socket's workers): that lookup cannot end a claim not yet recorded, so the
    claim ends itself and answers a miss, and only the second lookup's claim can
    commit True."""
    async with solo(work) as e:
        backend = _backend(e.ra)
        [stage] = e.ra.agent.service.stages.values()
        coord = stage.coordinator
        entered, go_on = threading.Event(), threading.Event()
        real = EmbeddedBackend.claim_rows

        def paused(self: EmbeddedBackend, task_id: int, lease: float,
                   tenant: int = 0) -> list[int] | None:
            rows = real(self, task_id, lease, tenant)
            if not entered.is_set():
                entered.set()
                assert go_on.wait(30)
            return rows

        backend.claim_rows = paused.__get__(backend)  # type: ignore[method-assign]
        try:
            assert await asyncio.to_thread(coord.lookup, "r", PROMPT) == 32
            claim = asyncio.ensure_future(asyncio.to_thread(coord.claim_load, "r"))
            assert await asyncio.to_thread(entered.wait, 30)
            assert await asyncio.to_thread(coord.lookup, "r", PROMPT) == 32
            go_on.set()
            first = await claim
            assert first is not None and first[:2] == (0, []) and first[3] == -1
            assert _locked(backend) == 8  # only the second lookup's pins
            second = await asyncio.to_thread(coord.claim_load, "r")
            assert second is not None and len(second[1]) == 8
            assert await asyncio.to_thread(coord.commit_load, "r", second[3]) is True
            assert _locked(backend) == 0
        finally:
            go_on.set()


async def test_released_claims_never_push_a_live_claim_out(work: Path) -> None:
    async with solo(work) as e:
        client, backend = e.client, _backend(e.ra)
        [stage] = e.ra.agent.service.stages.values()
        coord = stage.coordinator
        coord.cfg = type(coord.cfg)(**{**vars(coord.cfg), "max_pending": 4})
        assert await asyncio.to_thread(client.lookup, "live", PROMPT) == 32
        assert await asyncio.to_thread(client.claim_load, "live") is not None
        for i in range(10):  # more ended claims than the bound
            assert await asyncio.to_thread(client.lookup, f"x{i}", PROMPT) == 32
            assert await asyncio.to_thread(client.claim_load, f"x{i}") is not None
            await asyncio.to_thread(client.release, f"x{i}")
        assert await asyncio.to_thread(client.commit_load, "live") is True
        assert _locked(backend) == 0


async def test_a_claim_the_agent_forgot_makes_the_load_a_miss_not_an_error(
        work: Path) -> None:
    async with solo(work) as e:
        client, bufs, loads = e.client, e.bufs, e.loads
        dst = np.arange(64, 96, dtype=np.int64)
        zero_slots(bufs, dst)
        assert await asyncio.to_thread(loads.lookup, "r", PROMPT) == 32
        # The agent forgets every claim record of the stage (as a restarted agent
        # has none); the commit then names a claim it does not know.
        [stage] = e.ra.agent.service.stages.values()
        stage.coordinator._claims.clear()
        with pytest.raises(EngineAPIError, match="claim_load first"):
            await asyncio.to_thread(client.commit_load, "none-such", 5)
        # Another claim ends early (a release): the claim fence moves, so the
        # engine asks the agent, which knows no such claim.
        assert await asyncio.to_thread(client.lookup, "x", PROMPT) == 32
        assert await asyncio.to_thread(client.claim_load, "x") is not None
        await asyncio.to_thread(client.release, "x")
        assert await asyncio.to_thread(loads.load, "r", dst) == 0
        assert loads.loads == 0 and loads.fenced == 0
        # The next load of the prompt is copied and committed as usual.
        assert await asyncio.to_thread(loads.lookup, "r2", PROMPT) == 32
        assert await asyncio.to_thread(loads.load, "r2", dst) == 32
        assert equal_slots(bufs, SRC, dst)


def _outcomes(ra: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in ra.agent.metrics.registry.collect():
        if metric.name == "flexkv_agent_engine_loads":
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[s.labels["outcome"]] = s.value
    return out


def _fence_moves(ra: Any) -> float:
    [value] = [s.value for metric in ra.agent.metrics.registry.collect()
               if metric.name == "flexkv_agent_claim_fence_moves"
               for s in metric.samples if s.name.endswith("_total")]
    return float(value)


async def test_the_metric_says_how_each_claim_ended(work: Path) -> None:
    async with solo(work) as e:
        client = e.client
        for rid, end in (("c", "commit"), ("r", "release"), ("l", "lookup")):
            assert await asyncio.to_thread(client.lookup, rid, PROMPT) == 32
            got = await asyncio.to_thread(client.claim_load, rid)
            assert got is not None
            if end == "commit":
                assert await asyncio.to_thread(client.commit_load, rid) is True
            elif end == "release":
                await asyncio.to_thread(client.release, rid)
                assert await asyncio.to_thread(client.commit_load, rid) is False
            else:
                assert await asyncio.to_thread(client.lookup, rid, PROMPT) == 32
                await asyncio.to_thread(client.release, rid)
        assert _outcomes(e.ra) == {"committed": 1.0, "released": 2.0}
        # The two claims ended before any commit moved the claim fence; the commit
        # did not.
        assert _fence_moves(e.ra) == 2.0
        assert _backend(e.ra).store.cpu.fence_value() == 2


async def test_a_release_sent_without_waiting_lands_before_the_next_call(
        work: Path) -> None:
    """A single-stage agent answers ``release`` in arrival order, so the client
    sends it without waiting: the call right after it already finds the rid's
    lookup and claim ended, and its pins dropped."""
    async with solo(work) as e:
        client, backend = e.client, _backend(e.ra)
        dst = np.arange(64, 96, dtype=np.int64)
        assert await asyncio.to_thread(client.lookup, "r", PROMPT) == 32
        assert _locked(backend) == 8

        def release_then_retrieve() -> None:
            client.release_nowait("r")
            client.retrieve("r", dst)

        with pytest.raises(EngineAPIError, match="retrieve: unknown request id 'r'"):
            await asyncio.to_thread(release_then_retrieve)
        assert _locked(backend) == 0
        got = await asyncio.to_thread(client.lookup_claim, "c", PROMPT)
        assert got["blocks"] is not None and _locked(backend) == 8

        def release_then_commit() -> bool:
            client.release_nowait("c")
            return client.commit_load("c", got["claim"])

        assert await asyncio.to_thread(release_then_commit) is False
        assert _locked(backend) == 0
        assert _outcomes(e.ra) == {"released": 1.0}

"""The PP half of the vLLM connector without vLLM: the scheduler side (stage 0's calls)
and a :class:`StageCaller` (stage 1's worker) against two real agents forming the PP
group (leader pp0, follower pp1), in this event loop on loopback with real fan-out and
engine sockets. The test plays vLLM's steps: it hands the ops stage 0 recorded to
stage 1 (``take_stage_ops`` -> ``submit``, the step's metadata) and feeds the stage's
``loads_ended`` back into ``completions`` (its worker metadata), so it decides when
stage 1 makes its calls (vLLM-free: runs in the main venv)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.coordinator.follower import FollowerRole
from node_agent.integrations.vllm.config import AgentConnectorConfig
from node_agent.integrations.vllm.scheduler_side import SchedulerSide, block_slots
from node_agent.integrations.vllm.stage_calls import StageCaller, StageOp
from node_agent.pp.auth import CurveKeys
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    TPB,
    RunningAgent,
    agent_mapping,
    cfg_of,
    running_agent,
    short_dir,
    wait_http,
    write_group_file,
)
from tests.coordinator.test_stuck_load import hang_loads
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(180)
REPLICA = "rep"
PROMPT = [int(t) for t in np.arange(500, 500 + 4 * TPB + 1)]  # 4 whole blocks + 1 token
SRC_BLOCKS = [1, 2, 3, 4]


@pytest.fixture()
def work() -> Iterator[Path]:
    d = short_dir("ppcalls")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fill(bufs: SharedKVBuffers, blocks: list[int], value: float) -> None:
    slots = torch.as_tensor(block_slots(blocks, TPB))
    for group in bufs.tensors:
        for t in group:
            t[slots] = value


def _all(bufs: SharedKVBuffers, blocks: list[int], value: float) -> bool:
    slots = torch.as_tensor(block_slots(blocks, TPB))
    return all(bool(torch.all(t[slots] == value)) for g in bufs.tensors for t in g)


class Steps:
    """vLLM's steps as the connector sees them: each hands stage 0's recorded ops to
    stage 1 (when ``ship``) and reports what ``completions`` returned."""

    def __init__(self, sched: SchedulerSide, stage: StageCaller) -> None:
        self.sched, self.stage = sched, stage
        self.recv: set[str] = set()
        self.sent: set[str] = set()
        self.failed: set[str] = set()
        self.ended: set[str] = set()

    def step(self, ship: bool = True) -> None:
        """One step: the workers echo its failed loads' blocks in the same step."""
        report = self.sched.step_report()
        self.failed |= set(report.failed)
        if ship:
            self.stage.submit(self.sched.take_stage_ops())
        ended = {(1, rid) for rid in self.stage.take_loads_ended()}
        stuck = {(1, rid) for rid in self.stage.take_loads_stuck()}
        recv, sent = self.sched.completions(set(report.failed), ended, stuck)
        self.ended |= {rid for _, rid in ended}
        self.recv |= recv
        self.sent |= sent

    async def until(self, cond: Callable[[], bool], what: str, ship: bool = True,
                    timeout: float = 60.0) -> None:
        def check() -> bool:
            self.step(ship)
            return cond()
        await wait_for_async(lambda: asyncio.to_thread(check), what, timeout, interval=0.02)

    async def lookup(self, rid: str) -> int:
        """vLLM asking admission until stage 0's lookup answered (``None`` before)."""
        got: list[int] = []

        def ask() -> bool:
            hit = self.sched.lookup(rid, PROMPT, 0)
            self.step()
            if hit is not None:
                got.append(hit)
            return hit is not None

        await wait_for_async(lambda: asyncio.to_thread(ask), f"the lookup of {rid}", 60,
                             interval=0.02)
        return got[0]


@contextlib.asynccontextmanager
async def group(work: Path, agents: list[RunningAgent] | None = None, **extra: Any,
                ) -> AsyncIterator[tuple[list[SharedKVBuffers], AgentConnectorConfig]]:
    """Two agents forming the replica's PP group (stage 0's leads), each stage's KV
    buffers registered; yields the buffers and the connector's config. ``agents``,
    when given, receives the two running agents; ``extra`` goes to both agents'
    configuration."""
    CurveKeys.generate().write(work / "curve")
    maps = [agent_mapping(work, f"node-{r}", groupViewFile=str(work / "groups.yaml"), **extra)
            for r in (0, 1)]
    write_group_file(work / "groups.yaml", "tp", REPLICA,
                     {r: m["ports"]["fanout"] for r, m in enumerate(maps)})
    cfgs = [cfg_of(m) for m in maps]
    bufs = [SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS) for _ in range(2)]
    regs = [EngineClient(c.engine_socket, RankInfo(REPLICA, pp_rank=r, pp_size=2), timeout=10)
            for r, c in enumerate(cfgs)]
    conn = AgentConnectorConfig(engine_socket=str(work / "node-{ppRank}.sock"),
                                replica=REPLICA, call_timeout_seconds=60.0,
                                lookup_timeout_seconds=10.0, retry_seconds=0.5)
    try:
        async with running_agent(cfgs[0]) as lead, running_agent(cfgs[1]) as foll:
            for c, b in zip(regs, bufs, strict=True):
                await asyncio.to_thread(c.register_kv_buffers, LAYOUT, b.handles)
            for ra in (lead, foll):
                await wait_http(ra, "/readyz", 200, 30)
            if agents is not None:
                agents += [lead, foll]
            yield bufs, conn
    finally:
        for c in regs:
            c.close()
        for b in bufs:
            b.close()


@contextlib.asynccontextmanager
async def stored_group(work: Path) -> AsyncIterator[tuple[list[SharedKVBuffers], Steps]]:
    """:func:`group` with stage 0's scheduler side and stage 1's caller, played by
    :class:`Steps`, once a finished request's blocks (``SRC_BLOCKS``, each stage's
    own KV: 1.0 on stage 0, 2.0 on stage 1) are stored on both stages."""
    sched: SchedulerSide | None = None
    stage: StageCaller | None = None
    try:
        async with group(work) as (bufs, conn):
            sched = SchedulerSide(conn, TPB, tp_size=1, pp_size=2)
            stage = StageCaller(conn.socket_for(1), RankInfo(REPLICA, pp_rank=1, pp_size=2),
                                TPB, timeout=60.0, retry_seconds=0.5)
            steps = Steps(sched, stage)
            for r, b in enumerate(bufs):
                _fill(b, SRC_BLOCKS, 1.0 + r)  # each stage's own KV
            assert sched.finished("s", PROMPT, len(PROMPT), SRC_BLOCKS) is True
            await steps.until(lambda: "s" in steps.sent, "the store completed on every stage")
            yield bufs, steps
    finally:
        if sched is not None:
            sched.close()
        if stage is not None:
            stage.close()


async def test_a_load_is_reported_only_once_every_stage_ended_it_and_never_half_loaded(
        work: Path) -> None:
    async with stored_group(work) as (bufs, steps):
        sched = steps.sched
        # A load whose stage-1 retrieve comes late: the leader gives up on stage 1,
        # stage 0's load fails, and the failed load is held (vLLM would recompute
        # into blocks stage 1's call may still name) until stage 1 reported it.
        late = [10, 11, 12, 13]
        for b in bufs:
            _fill(b, late, -7.0)
        assert await steps.lookup("late") == 4 * TPB
        sched.after_alloc("late", late, 4 * TPB)
        await steps.until(lambda: "late" in steps.failed,
                          "stage 0's load of the late request failed", ship=False)
        steps.step(ship=False)  # its failed blocks were echoed, stage 1 not called yet
        assert "late" not in steps.recv, "load reported before stage 1's retrieve ended"
        await steps.until(lambda: "late" in steps.recv, "the late load reported")
        assert _all(bufs[0], late, -7.0) and _all(bufs[1], late, -7.0), \
            "a stage's blocks were written by a load that failed"
        sched.finished("late", PROMPT, 0, late)

        # A load whose stages call in step: both stages' blocks hold their own KV.
        ok = [20, 21, 22, 23]
        assert await steps.lookup("ok") == 4 * TPB
        sched.after_alloc("ok", ok, 4 * TPB)
        await steps.until(lambda: "ok" in steps.recv, "the load reported")
        assert _all(bufs[0], ok, 1.0) and _all(bufs[1], ok, 2.0)
        assert sched.take_counters()["loads"] == 1


async def test_a_load_another_stage_could_not_stop_never_gives_its_blocks_back(
        work: Path) -> None:
    """Stage 1's agent answers its ``retrieve`` ``SlotsInUse`` (its copy ignores its
    abort, like a hung device, and may write stage 1's blocks later): stage 0's
    miss must not be reported (vLLM would recompute into the blocks, on every
    stage), neither once stage 1's call ended; the request's blocks stay held."""
    sched: SchedulerSide | None = None
    stage: StageCaller | None = None
    agents: list[RunningAgent] = []
    release: threading.Event | None = None
    try:
        async with group(work, agents, timeouts={"engineCallSeconds": 2,
                                                 "fanoutWaitSeconds": 1}) as (bufs, conn):
            sched = SchedulerSide(conn, TPB, tp_size=1, pp_size=2)
            stage = StageCaller(conn.socket_for(1), RankInfo(REPLICA, pp_rank=1, pp_size=2),
                                TPB, timeout=60.0, retry_seconds=0.5)
            steps = Steps(sched, stage)
            for r, b in enumerate(bufs):
                _fill(b, SRC_BLOCKS, 1.0 + r)
            assert sched.finished("s", PROMPT, len(PROMPT), SRC_BLOCKS) is True
            await steps.until(lambda: "s" in steps.sent, "the store completed on every stage")

            [follower_stage] = agents[1].agent.service.stages.values()
            role = follower_stage.coordinator._role
            assert isinstance(role, FollowerRole)
            started, release = hang_loads(role.store)
            stuck = [10, 11, 12, 13]
            try:
                assert await steps.lookup("stuck") == 4 * TPB
                sched.after_alloc("stuck", stuck, 4 * TPB)
                await steps.until(lambda: "stuck" in steps.ended,
                                  "stage 1's retrieve answered")
                await steps.until(lambda: sched.take_counters()["load_failures"] == 1,
                                  "stage 0's retrieve answered")
                steps.step()
            finally:
                release.set()  # the hung copy ends before the agents stop
            assert started.is_set()
            assert role.counters.loads_still_writing == 1
            assert "stuck" not in steps.recv, (
                "a load whose stage-1 copy may still write its blocks was reported "
                "finished: vLLM recomputes into them or gives them to another request")
            assert sched.finished("stuck", PROMPT, 0, stuck) is True, \
                "vLLM would free blocks stage 1's copy may still write"
    finally:
        if release is not None:
            release.set()
        if sched is not None:
            sched.close()
        if stage is not None:
            stage.close()


async def test_closing_a_stage_caller_drops_its_queued_calls(work: Path) -> None:
    """An engine shutting down while stage 1 has calls queued: ``close`` ends the
    thread after the call in flight, and none of the queued calls is made after it."""
    async with group(work) as (_, conn):
        stage = StageCaller(conn.socket_for(1), RankInfo(REPLICA, pp_rank=1, pp_size=2),
                            TPB, timeout=5.0, retry_seconds=0.5)
        try:
            # Stage 0 never makes these lookups: each waits for a decision that never
            # comes (the agent's fanoutWaitSeconds), so most stay queued.
            tokens = np.asarray(PROMPT, dtype=np.int64)
            stage.submit(StageOp("lookup", f"q{i}", tokens=tokens, span=(0, 4 * TPB))
                         for i in range(20))
            await wait_for_async(lambda: stage.calls >= 1, "stage 1's first call", 60)
        finally:
            await asyncio.to_thread(stage.close)
        made = stage.calls
        assert made < 20
        assert not stage._thread.is_alive(), "stage 1's thread still makes queued calls after close"
        assert stage.calls == made


async def test_a_request_ended_while_its_lookup_is_queued_leaves_no_lookup_open(
        work: Path) -> None:
    """vLLM aborts a waiting request whose PP lookup is still queued on the lookup
    thread: its release reaches stage 0's agent first, the lookup after it. The
    lookup the agent then holds (pinning the prompt's blocks) must be released too,
    or every such abort leaves a match open until ``maxPending`` newer lookups push
    it out."""
    sched: SchedulerSide | None = None
    try:
        async with group(work) as (_, conn):
            sched = SchedulerSide(conn, TPB, tp_size=1, pp_size=2)
            client = EngineClient(conn.socket_for(0), RankInfo(REPLICA, pp_rank=0, pp_size=2),
                                  timeout=10)
            try:
                # The lookup thread is held before its call until the release was made.
                gate, released = threading.Event(), threading.Event()
                real_call, real_release = sched._call_lookup, sched._release

                def held_call(rid: str, ids: np.ndarray, local: int, limit: int) -> int:
                    assert gate.wait(60), "the test never opened the gate"
                    return real_call(rid, ids, local, limit)

                def noted_release(rid: str, c: EngineClient | None = None) -> None:
                    real_release(rid, c)
                    if rid == "gone":
                        released.set()

                sched._call_lookup = held_call  # type: ignore[method-assign]
                sched._release = noted_release  # type: ignore[method-assign]
                assert sched.lookup("gone", PROMPT, 0) is None  # queued, not answered
                assert sched.finished("gone", PROMPT, 0, []) is False  # aborted
                assert await asyncio.to_thread(released.wait, 60), "the release was not made"
                gate.set()
                await wait_for_async(lambda: sched is not None and sched._lookup_jobs.empty()
                                     and sched.take_counters()["lookups"] >= 1,
                                     "the queued lookup made after the release", 60)

                def open_lookups() -> int:
                    [stage] = client.status()["stages"]
                    return int(stage["connector"]["openLookups"])

                await wait_for_async(lambda: open_lookups() == 0,
                                     "the late lookup of an ended request released", 30)
            finally:
                client.close()
    finally:
        if sched is not None:
            sched.close()

"""The scheduler side's load completion as vLLM's empty steps see it, without vLLM:
one real agent on a real engine socket, the test playing vLLM's steps. While every
request waits for a load, each step schedules nothing and the connector waits in it
(``idle_wait``) for a load to end; the load must then be reported by the
``completions`` of that same step, with the agent's KV in the engine's blocks. A
step whose own worker report completes a load (a failed load's blocks echoed, the
last PP stage's ``retrieve`` ended) reports it without that wait
(vLLM-free: runs in the main venv)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from node_agent.client import EngineClient, RankInfo, SharedKVBuffers
from node_agent.integrations.vllm.config import AgentConnectorConfig
from node_agent.integrations.vllm.scheduler_side import SchedulerSide
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    TPB,
    agent_mapping,
    cfg_of,
    running_agent,
    wait_http,
)
from tests.support.waiting import wait_for_async
from tests.vllm.test_pp_stage_calls import (
    PROMPT,
    REPLICA,
    SRC_BLOCKS,
    _all,
    _fill,
    stored_group,
    work,
)

__all__ = ["work"]  # the fixture, shared with the PP module

pytestmark = pytest.mark.timeout(180)


async def test_a_load_ending_in_an_empty_steps_wait_is_reported_by_that_step(
        work: Path) -> None:
    mapping = agent_mapping(work, "solo")
    cfg = cfg_of(mapping)
    conn = AgentConnectorConfig(engine_socket=str(cfg.engine_socket), replica=REPLICA,
                                call_timeout_seconds=60.0, lookup_timeout_seconds=10.0,
                                retry_seconds=0.5)
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    reg = EngineClient(cfg.engine_socket, RankInfo(REPLICA), timeout=10)
    sched: SchedulerSide | None = None
    try:
        async with running_agent(cfg) as ra:
            await asyncio.to_thread(reg.register_kv_buffers, LAYOUT, bufs.handles)
            await wait_http(ra, "/readyz", 200, 30)
            sched = SchedulerSide(conn, TPB, tp_size=1)
            s = sched
            _fill(bufs, SRC_BLOCKS, 3.0)
            assert s.finished("stored", PROMPT, len(PROMPT), SRC_BLOCKS) is True
            sent: set[str] = set()

            def stored() -> bool:
                sent.update(s.completions(set())[1])
                return "stored" in sent

            await wait_for_async(lambda: asyncio.to_thread(stored), "the store completed", 60)

            dst = [10, 11, 12, 13]
            _fill(bufs, dst, -1.0)
            hit = await asyncio.to_thread(s.lookup, "r", PROMPT, 0)
            assert hit == 4 * TPB
            await asyncio.to_thread(s.after_alloc, "r", dst, hit)
            # vLLM's empty steps while the request waits: each step's wait returns
            # once the load ended (or after its bound), then the step's completions.
            recv: set[str] = set()
            steps = 0
            while "r" not in recv and steps < 3:
                report = s.step_report()
                assert report.pending, "a load in flight is not pending"
                assert not report.failed, f"the load failed: {report.failed}"
                await asyncio.to_thread(s.idle_wait, 60.0)
                recv |= s.completions(set())[0]
                steps += 1
            # With a bound far above the copy, the step that waited reports the load.
            assert steps == 1, f"the load was reported {steps} steps after its wait"
            assert _all(bufs, dst, 3.0), "the reported load did not put the agent's KV"
            assert s.take_counters()["loads"] == 1
    finally:
        if sched is not None:
            sched.close()
        reg.close()
        bufs.close()


class _NoWait(threading.Event):
    """The scheduler side's load-ended event, failing the test when a step waits on it."""

    def wait(self, timeout: float | None = None) -> bool:
        raise AssertionError(f"an empty step waited (up to {timeout}s) for a load to end "
                             "although its own worker report completed one")


def test_an_empty_step_whose_workers_echo_a_failed_load_reports_it_without_waiting(
        work: Path) -> None:
    # No agent is called: vLLM allocating tokens no lookup promised fails the load.
    conn = AgentConnectorConfig(engine_socket=str(work / "absent.sock"), replica=REPLICA,
                                call_timeout_seconds=5.0, retry_seconds=0.5)
    s = SchedulerSide(conn, TPB, tp_size=1)
    try:
        s.after_alloc("r", [10, 11], 2 * TPB)
        report = s.step_report()
        assert report.failed == {"r": [10, 11]}
        # The step that sent the blocks ran (it scheduled nothing) and its workers
        # echoed them: the load is reported now, not after an idle wait.
        s._load_ended = _NoWait()
        recv, _ = s.step_output(set(report.failed), (), empty=True)
        assert recv == {"r"}
    finally:
        s.close()


async def test_an_empty_step_whose_workers_report_the_last_stages_load_reports_it_without_waiting(
        work: Path) -> None:
    async with stored_group(work) as (bufs, steps):
        s, st = steps.sched, steps.stage
        dst = [20, 21, 22, 23]
        assert await steps.lookup("r") == 4 * TPB
        s.after_alloc("r", dst, 4 * TPB)
        st.submit(s.take_stage_ops())  # stage 1's retrieve; its end is kept back below
        ended: set[tuple[int, str]] = set()
        loads = [0]

        def both_ended() -> bool:
            ended.update((1, rid) for rid in st.take_loads_ended())
            loads[0] += s.take_counters()["loads"]
            return (1, "r") in ended and loads[0] == 1

        await wait_for_async(lambda: asyncio.to_thread(both_ended),
                             "both stages' retrieves ended", 60)
        # An empty step without stage 1's report: stage 0's load is held.
        report = s.step_report()
        recv, _ = await asyncio.to_thread(s.step_output, set(report.failed), set(), True)
        assert "r" not in recv, "a load was reported before stage 1's retrieve ended"
        # The empty step whose workers report it: the load is reported at once.
        s._load_ended = _NoWait()
        report = s.step_report()
        recv, _ = s.step_output(set(report.failed), ended, empty=True)
        assert recv == {"r"}
        assert _all(bufs[0], dst, 1.0) and _all(bufs[1], dst, 2.0)

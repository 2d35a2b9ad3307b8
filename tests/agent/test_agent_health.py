"""The client's one resilience policy (:class:`node_agent.client.AgentHealth`), which
the vLLM connector and the SGLang plugin share: down after a call fails because
the agent is down, no calls while down except a probe every retry period, each
outage logged once with its end, hooks for counters and gauges."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from node_agent.client import (
    AgentHealth,
    AgentTimeoutError,
    AgentUnavailableError,
    EngineAPIError,
    EngineClient,
    RankInfo,
    agent_down,
)
from tests.support.clock import ManualClock
from tests.support.waiting import wait_for


def _unavailable(tmp_path: Path) -> AgentUnavailableError:
    """The error a real client raises when no agent listens."""
    client = EngineClient(tmp_path / "nobody.sock", RankInfo("r"), timeout=1)
    with pytest.raises(AgentUnavailableError) as err:
        client.ping()
    client.close()
    return err.value


@pytest.mark.parametrize(("exc", "down"), [
    (AgentUnavailableError("gone"), True),
    (AgentTimeoutError("no answer"), True),
    (ConnectionError("reset"), True),
    (OSError("broken pipe"), True),
    (EngineAPIError("NotReady", "restarting"), True),
    (EngineAPIError("InternalError", "bug"), True),
    (EngineAPIError("KeyError", "no such rid"), False),
    (EngineAPIError("ProtocolError", "bad header"), False),
    (ValueError("store_kv: token_ids has 3 entries but kv_indices has 2 entries"), False),
])
def test_agent_down_tells_an_absent_agent_from_an_answer_about_one_call(
        exc: BaseException, down: bool) -> None:
    assert agent_down(exc) is down


def test_a_refused_call_leaves_the_agent_up(caplog: pytest.LogCaptureFixture) -> None:
    health = AgentHealth(5, clock=ManualClock())
    with caplog.at_level(logging.WARNING, logger="node_agent.client"):
        assert health.failed("lookup", EngineAPIError("KeyError", "no such rid")) is False
    assert not health.down and health.should_call()
    assert [r.getMessage() for r in caplog.records] == [
        "FlexKV agent refused lookup, treating it as a miss: KeyError: no such rid"]


def test_while_down_only_one_probe_per_retry_period_is_granted(tmp_path: Path) -> None:
    clock = ManualClock()
    health = AgentHealth(5, clock=clock)
    assert health.should_call() and health.should_call()  # up: every call goes
    assert health.failed("lookup", _unavailable(tmp_path)) is True
    assert health.down
    assert [health.should_call() for _ in range(3)] == [False] * 3
    clock.now += 4.9
    assert not health.should_call()
    clock.now += 0.1
    assert health.should_call()  # the probe
    assert not health.should_call()  # claimed: the next one retry_seconds later
    clock.now += 5
    assert health.should_call()
    health.succeeded()
    assert not health.down and health.should_call() and health.should_call()


def test_a_failed_probe_waits_a_whole_period_again(tmp_path: Path) -> None:
    clock = ManualClock()
    health = AgentHealth(5, clock=clock)
    health.failed("lookup", _unavailable(tmp_path))
    clock.now += 5
    assert health.should_call()
    clock.now += 2
    health.failed("ping", AgentTimeoutError("no answer"))
    clock.now += 4
    assert not health.should_call()
    clock.now += 1
    assert health.should_call()


def test_retry_now_grants_a_probe_at_once(tmp_path: Path) -> None:
    health = AgentHealth(5, clock=ManualClock())
    health.failed("register", _unavailable(tmp_path))
    assert not health.should_call()
    health.retry_now()
    assert health.should_call()


def test_each_outage_and_its_end_are_logged_once_and_hooks_run(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    failures: list[int] = []
    changes: list[bool] = []
    health = AgentHealth(5, clock=ManualClock(), on_failure=lambda: failures.append(1),
                         on_change=changes.append, name="Node agent",
                         fallback="SGLang continues on its own radix cache",
                         resumed="KV offload resumed")
    with caplog.at_level(logging.WARNING, logger="node_agent.client"):
        for _ in range(2):  # two outages
            health.failed("lookup", _unavailable(tmp_path))
            health.failed("store_kv", AgentTimeoutError("no answer"))  # another kind
            health.failed("ping", EngineAPIError("NotReady", "restarting"))
            health.succeeded()
            health.succeeded()
    messages = [r.getMessage() for r in caplog.records]
    starts = [m for m in messages if "unavailable" in m]
    ends = [m for m in messages if "reachable again" in m]
    assert len(starts) == 2 and len(ends) == 2 and len(messages) == 4
    assert starts[0].startswith("Node agent unavailable, SGLang continues on its own radix "
                                "cache and calling it again only once it answers a probe "
                                "(every 5s): lookup failed: no flexkv agent at ipc://")
    assert ends[0] == "Node agent reachable again, KV offload resumed"
    assert caplog.records[0].op == "lookup"  # type: ignore[attr-defined]
    assert len(failures) == 6  # every failure that means down is counted
    assert changes == [False, True, False, True]


def test_a_probe_thread_brings_the_agent_back_and_nothing_else_calls_meanwhile(
        tmp_path: Path) -> None:
    answers = threading.Event()
    probes: list[int] = []

    def probe() -> None:
        probes.append(1)
        if not answers.is_set():
            raise AgentUnavailableError("still gone")

    health = AgentHealth(0.01, probe=probe)
    try:
        health.failed("lookup", _unavailable(tmp_path))
        wait_for(lambda: len(probes) >= 3, "three failed probes")
        assert health.down and not health.should_call()  # the thread probes, callers never
        answers.set()
        wait_for(lambda: not health.down, "the probe thread to mark the agent up")
        assert health.should_call()
        # A later outage starts a new probe thread.
        health.failed("retrieve", AgentTimeoutError("no answer"))
        assert not health.should_call()
        wait_for(lambda: not health.down, "the second probe thread to mark the agent up")
    finally:
        health.close()


def test_a_closed_policy_stops_probing(tmp_path: Path) -> None:
    probes: list[int] = []

    def probe() -> None:
        probes.append(1)
        raise AgentUnavailableError("still gone")

    health = AgentHealth(0.01, probe=probe)
    health.failed("lookup", _unavailable(tmp_path))
    wait_for(lambda: probes, "a first probe")
    health.close()
    wait_for(lambda: not any(t.name == "flexkv-probe" and t.is_alive()
                             for t in threading.enumerate()), "the probe thread to end")
    assert health.down  # closed while down: nothing marked it up


def test_retry_seconds_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"retry_seconds=0 must be > 0 seconds"):
        AgentHealth(0)

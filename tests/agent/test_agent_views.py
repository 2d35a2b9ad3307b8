"""Agent bookkeeping races and faults, driven deterministically: group-view pushes
to a new stage against a concurrent update, /readyz against a view map replaced
while it is read, and the cache-epoch watcher surviving a failing flush."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.agent import Agent
from node_agent.assembly import default_stage_builder
from node_agent.engine_api.service import RankRef, Stage
from node_agent.pp.auth import CurveKeys
from node_agent.vocab.group_view import GroupMember, GroupView
from tests.agent.harness import LAYOUT, agent_mapping, cfg_of
from tests.support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def work(work: Path) -> Path:
    """The test's work directory with the agents' CURVE keys in ``curve``."""
    CurveKeys.generate().write(work / "curve")
    return work


def _view(peer_ready: bool) -> GroupView:
    lead = GroupMember("node-0", 0, "tcp://127.0.0.1:1")
    peer = GroupMember("node-1", 1, "tcp://127.0.0.1:2", ready=peer_ready)
    return GroupView(group="tp-rep", replica="rep", pp_size=2, epoch=1, leader=lead,
                     members=(lead, peer))


def _pp_stage(agent: Agent) -> Stage:
    stage = agent._build_stage(RankRef("rep", 0, 2, 0, 1), LAYOUT)
    agent.service.stages[stage.key] = stage
    return stage


def test_attach_never_pushes_an_older_view_over_a_newer_one(work: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    agent = Agent(cfg_of(agent_mapping(work, "node-0")), default_stage_builder)
    agent.group_views = {"rep": _view(peer_ready=True)}  # the view attach will read
    stage = agent._build_stage(RankRef("rep", 0, 2, 0, 1), LAYOUT)
    newer = {"rep": _view(peer_ready=False)}
    real_push = agent._push_view
    racer: list[threading.Thread] = []

    def push(st: Stage, view: GroupView) -> None:
        if not racer:
            # Between attach's read and its push, a newer view arrives.
            t = threading.Thread(target=agent._on_views, args=(newer,))
            racer.append(t)
            t.start()
            t.join(0.5)  # with the lock it waits for this push to finish
        real_push(st, view)

    monkeypatch.setattr(agent, "_push_view", push)
    try:
        agent.service.stages[stage.key] = stage
        agent.attach_stage(stage)
        racer[0].join(5.0)
        assert not racer[0].is_alive()
        members = {m.pp_rank: m.ready for m in stage.views.view.members}
        assert members == {0: True, 1: False}, "the older view won the race"
        assert agent.group_views is newer
    finally:
        agent.service.close()


class _ReplacedWhileRead(dict[str, GroupView]):
    """A view map that another thread replaced between a membership test and the
    item read (what ``_on_views`` does to ``group_views``)."""

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> GroupView:
        raise KeyError(key)


def test_readiness_reads_one_snapshot_of_the_views(work: Path) -> None:
    agent = Agent(cfg_of(agent_mapping(work, "node-0")), default_stage_builder)
    _pp_stage(agent)
    try:
        agent.group_views = _ReplacedWhileRead()
        comps = agent.readiness()
        assert comps["group_view"]["ready"] is False
        assert comps["group_view"]["missing"] == ["rep"]
        agent.group_views = {"rep": _view(peer_ready=False)}
        comps = agent.readiness()
        assert comps["group_view"]["unreadyMembers"] == ["rep/pp1"]
    finally:
        agent.service.close()


async def test_epoch_watcher_survives_a_failing_flush_and_reports_liveness(
        work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mapping = agent_mapping(work, "node-0")
    path = work / "agent.yaml"
    path.write_text(yaml.safe_dump(mapping))
    agent = Agent(cfg_of(mapping), default_stage_builder, config_path=path)
    assert agent.liveness()["cache_epoch"] is True
    real_flush = agent.flush
    calls: list[int] = []

    def flaky_flush(epoch: int) -> None:
        calls.append(epoch)
        if len(calls) == 1:
            raise RuntimeError("backend reset failed")
        real_flush(epoch)

    monkeypatch.setattr(agent, "flush", flaky_flush)
    watcher: Any = agent._epoch_watcher
    await watcher.start()
    try:
        path.write_text(yaml.safe_dump({**mapping, "cacheEpoch": 3}))
        await wait_for_async(lambda: agent.cache_epoch == 3, "flush after a failed one", 10)
        assert len(calls) >= 2
        assert any("backend reset failed" in e["message"] for e in agent.errors.snapshot())
        assert agent.liveness()["cache_epoch"] is True
        await watcher.stop()
        assert agent.liveness()["cache_epoch"] is False
    finally:
        await watcher.stop()
        await asyncio.sleep(0)

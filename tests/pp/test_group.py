"""Group view: parsing the KVCacheGroup status shape, monotonic epochs, file reload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.pp.group import (
    GroupView,
    GroupViewError,
    GroupViewFile,
    GroupViewSource,
    StaleViewError,
    load_view_file,
)
from tests.support.waiting import wait_for


def status(epoch: int, leader: int, size: int = 3) -> dict[str, Any]:
    members = [{"node": f"n{r}", "ppRank": r, "fanoutEndpoint": f"tcp://127.0.0.1:{6000 + r}",
                "ready": True, "lastHeartbeat": "2026-11-30T12:00:00Z"} for r in range(size)]
    return {"epoch": epoch, "leader": dict(members[leader]), "members": members,
            "phase": "Ready"}


def test_status_shape_parses_into_a_view() -> None:
    v = GroupView.from_status("pool-llama-0", status(3, 0))
    assert (v.group, v.epoch, v.size) == ("pool-llama-0", 3, 3)
    assert v.leader is not None and v.leader.pp_rank == 0
    assert [m.pp_rank for m in v.followers()] == [1, 2]
    assert v.member(2) is not None and v.member(2).fanout_endpoint == "tcp://127.0.0.1:6002"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "patch, reason",
    [
        ({"epoch": -1}, "status.epoch"),
        ({"epoch": "3"}, "status.epoch"),
        ({"members": "x"}, "must be a list"),
        ({"leader": {"node": "n9", "ppRank": 9, "fanoutEndpoint": "tcp://127.0.0.1:1"}},
         "not a member"),
        ({"leader": {"node": "n0", "ppRank": 0, "fanoutEndpoint": "10.0.0.1:5557"}},
         "tcp://host:port"),
    ],
)
def test_bad_status_names_the_field(patch: dict[str, Any], reason: str) -> None:
    with pytest.raises(GroupViewError, match=reason):
        GroupView.from_status("g", {**status(1, 0), **patch})


def test_duplicate_ranks_are_refused() -> None:
    s = status(1, 0)
    s["members"][1]["ppRank"] = 0
    with pytest.raises(GroupViewError, match="duplicate ppRank"):
        GroupView.from_status("g", s)


def test_epochs_never_go_back_and_one_leader_per_epoch() -> None:
    src = GroupViewSource(GroupView.from_status("g", status(2, 0)))
    seen: list[int] = []
    src.subscribe(lambda v: seen.append(v.epoch))
    assert src.update_from_status(status(3, 1)) is True
    assert src.update_from_status(status(3, 1)) is False
    with pytest.raises(StaleViewError, match="older"):
        src.update_from_status(status(2, 0))
    with pytest.raises(StaleViewError, match="already has leader rank 1"):
        src.update_from_status(status(3, 2))
    assert seen == [3] and src.view.epoch == 3


def test_file_view_reloads_on_change(tmp_path: Path) -> None:
    path = tmp_path / "group.yaml"
    path.write_text(yaml.safe_dump({"metadata": {"name": "g"}, "status": status(1, 0)}))
    fv = GroupViewFile(path, interval=0.02).start()
    seen: list[int] = []
    fv.source.subscribe(lambda v: seen.append(v.epoch))
    try:
        path.write_text(yaml.safe_dump({"group": "g", "status": status(2, 1)}))
        wait_for(lambda: seen, "the rewritten view", 5)
        assert seen == [2] and fv.source.view.leader.pp_rank == 1  # type: ignore[union-attr]
        path.write_text("{not yaml: [")  # a broken write keeps the last good view
        wait_for(lambda: fv._stamp == fv._stat(), "the poller reading the broken write", 5)
        assert fv.source.view.epoch == 2 and seen == [2]
    finally:
        fv.stop()


def test_json_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "group.json"
    path.write_text(json.dumps({"group": "g", "status": status(4, 2)}))
    v = load_view_file(path)
    assert v.epoch == 4 and v.leader is not None and v.leader.pp_rank == 2

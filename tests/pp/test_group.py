"""Group view: parsing the KVCacheGroup shape, monotonic epochs, file reload."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.kube.groups import FileGroupSource
from node_agent.pp.group import GroupViewSource, StaleViewError
from node_agent.vocab.group_view import GroupView, GroupViewError
from tests.support.group_views import update_status, view_of


def status(epoch: int, leader: int, size: int = 3) -> dict[str, Any]:
    members = [{"node": f"n{r}", "ppRank": r, "fanoutEndpoint": f"tcp://127.0.0.1:{6000 + r}",
                "ready": True, "lastHeartbeat": "2026-11-30T12:00:00Z"} for r in range(size)]
    return {"epoch": epoch, "leader": dict(members[leader]), "members": members,
            "phase": "Ready"}


def group_object(name: str, st: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"poolRef": "p", "replica": name, "ppSize": 3},
            "status": st}


def test_status_shape_parses_into_a_view() -> None:
    v = view_of("pool-llama-0", status(3, 0))
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
        view_of("g", {**status(1, 0), **patch})


def test_duplicate_ranks_are_refused() -> None:
    s = status(1, 0)
    s["members"][1]["ppRank"] = 0
    with pytest.raises(GroupViewError, match="duplicate ppRank"):
        view_of("g", s)


def test_epochs_never_go_back_and_one_leader_per_epoch() -> None:
    src = GroupViewSource(view_of("g", status(2, 0)))
    seen: list[int] = []
    src.subscribe(lambda v: seen.append(v.epoch))
    assert update_status(src, status(3, 1)) is True
    assert update_status(src, status(3, 1)) is False
    with pytest.raises(StaleViewError, match="older"):
        update_status(src, status(2, 0))
    with pytest.raises(StaleViewError, match="already has leader rank 1"):
        update_status(src, status(3, 2))
    assert seen == [3] and src.view.epoch == 3


def _write(path: Path, text: str) -> None:
    """Write ``text`` and move the modification time forward (two writes within one
    clock tick of the file system must still read as a change)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    if path.stat().st_mtime_ns <= before:
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


def test_file_view_reloads_on_change(tmp_path: Path) -> None:
    path = tmp_path / "groups.yaml"
    _write(path, yaml.safe_dump([group_object("g", status(1, 0))]))
    seen: list[dict[str, GroupView]] = []
    src = FileGroupSource(path, "p", seen.append, period=1.0)
    assert src.poll_once() is True and seen[-1]["g"].epoch == 1
    assert src.poll_once() is False  # unchanged file: nothing delivered
    _write(path, yaml.safe_dump({"items": [group_object("g", status(2, 1))]}))
    assert src.poll_once() is True
    leader = seen[-1]["g"].leader
    assert seen[-1]["g"].epoch == 2 and leader is not None and leader.pp_rank == 1
    _write(path, "{not yaml: [")  # a broken write keeps the last good view
    with pytest.raises(yaml.YAMLError):
        src.poll_once()
    assert len(seen) == 2 and src.views is not None and src.views["g"].epoch == 2


def test_json_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "groups.json"
    path.write_text(json.dumps([group_object("g", status(4, 2))]))
    seen: list[dict[str, GroupView]] = []
    assert FileGroupSource(path, "p", seen.append, period=1.0).poll_once() is True
    v = seen[-1]["g"]
    assert v.epoch == 4 and v.leader is not None and v.leader.pp_rank == 2

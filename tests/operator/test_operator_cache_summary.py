"""The pool's hit rate and tier use in its status and ``kubectl get`` columns.

Agents report the tokens looked up and found over their recent window in the
``flexkv.io/lookups`` Lease annotation; the operator sums them, with the tiers'
capacity and use, over the agents whose heartbeat is fresh."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from flexkv_operator import names
from flexkv_operator.membership import AgentView, parse_lease
from flexkv_operator.status import cache_summary

CRD = Path(__file__).parents[2] / "operator/flexkv_operator/crds/kvcachepools.flexkv.io.yaml"
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def _lease(node: str, *, lookups: Any = None, tiers: Any = None) -> dict[str, Any]:
    annotations = {names.ANNOTATION_READY: "true"}
    if lookups is not None:
        annotations[names.ANNOTATION_LOOKUPS] = (
            lookups if isinstance(lookups, str) else json.dumps(lookups)
        )
    if tiers is not None:
        annotations[names.ANNOTATION_TIERS] = json.dumps(tiers)
    return {
        "metadata": {
            "name": f"flexkv-agent-{node}", "namespace": "ns",
            "labels": {names.LABEL_NAME: names.AGENT_APP, names.LABEL_POOL: "pool",
                       names.LABEL_NODE: node},
            "annotations": annotations,
        },
        "spec": {"holderIdentity": f"pod-{node}", "leaseDurationSeconds": 15},
    }


def _view(body: dict[str, Any], fresh: bool = True) -> AgentView:
    record = parse_lease(body)
    assert record is not None
    return AgentView(record=record, fresh=fresh, expires_at=0.0, last_heartbeat=NOW)


def _window(looked_up: int, hit: int) -> dict[str, int]:
    return {"windowSeconds": 300, "lookupTokens": looked_up, "hitTokens": hit}


def test_the_pool_hit_rate_sums_the_fresh_agents_windows_and_leaves_a_lost_one_out() -> None:
    agents = [
        _view(_lease("a", lookups=_window(1000, 750))),
        _view(_lease("b", lookups=_window(3000, 1250))),
        _view(_lease("c", lookups=_window(5000, 5000)), fresh=False),
        _view(_lease("d")),  # its backend does not count lookups
    ]
    summary = cache_summary(agents)
    assert (summary["lookupTokens"], summary["hitTokens"]) == (4000, 2000)
    assert summary["hitRate"] == "50%"
    assert summary["reportingAgents"] == 2


def test_tier_use_is_the_sum_of_the_fresh_agents_tiers() -> None:
    gib = 1 << 30
    agents = [
        _view(_lease("a", tiers={"cpu": {"capacityBytes": 4 * gib, "usedBytes": gib},
                                 "ssd": {"capacityBytes": 10 * gib, "usedBytes": 0}})),
        _view(_lease("b", tiers={"cpu": {"capacityBytes": 4 * gib, "usedBytes": 2 * gib}})),
        _view(_lease("c", tiers={"cpu": {"capacityBytes": 4 * gib, "usedBytes": 4 * gib}}),
              fresh=False),
    ]
    tiers = cache_summary(agents)["tiers"]
    assert tiers["cpu"] == {"capacityBytes": 8 * gib, "usedBytes": 3 * gib, "use": "38%"}
    assert tiers["ssd"] == {"capacityBytes": 10 * gib, "usedBytes": 0, "use": "0%"}


def test_a_pool_without_lookups_or_agents_shows_a_dash_not_a_rate() -> None:
    assert cache_summary([])["hitRate"] == "-"
    assert cache_summary([_view(_lease("a", lookups=_window(0, 0)))])["hitRate"] == "-"


@pytest.mark.parametrize(
    ("annotation", "problem"),
    [
        ("not json", "is not JSON"),
        ({"windowSeconds": 300, "lookupTokens": -1, "hitTokens": 0}, "non-negative integers"),
        ({"windowSeconds": 300, "lookupTokens": 10}, "non-negative integers"),
        ({"windowSeconds": 300, "lookupTokens": True, "hitTokens": 0}, "non-negative integers"),
        ([1, 2, 3], "non-negative integers"),
        ({"windowSeconds": 300, "lookupTokens": 10, "hitTokens": 11}, "hitTokens=11 above"),
    ],
)
def test_a_malformed_lookups_annotation_is_named_and_not_counted(
    annotation: Any, problem: str
) -> None:
    record = parse_lease(_lease("a", lookups=annotation))
    assert record is not None and record.lookups is None
    assert any(problem in p and names.ANNOTATION_LOOKUPS in p for p in record.problems), (
        record.problems
    )


def test_a_changed_hit_count_alone_does_not_ask_for_a_reconcile() -> None:
    before = parse_lease(_lease("a", lookups=_window(10, 5)))
    after = parse_lease(_lease("a", lookups=_window(20, 15)))
    assert before is not None and after is not None
    assert before.significant() == after.significant()
    assert before.lookups != after.lookups


def _resolve(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for part in path.strip(".").split("."):
        if node is None:
            return None
        props = node.get("properties")
        if props is not None and part in props:
            node = props[part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def test_every_printer_column_names_a_field_of_the_schema_with_its_type() -> None:
    version = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    columns = version["additionalPrinterColumns"]
    assert {"Hit Rate", "CPU Use", "SSD Use"} <= {c["name"] for c in columns}
    for column in columns:
        if column["jsonPath"].startswith(".metadata."):
            continue
        field = _resolve(schema, column["jsonPath"])
        assert field is not None, f"column {column['name']}: {column['jsonPath']} not in schema"
        assert field["type"] == column["type"], column["name"]


@pytest.mark.parametrize("bad", ["1e400", "NaN", "true", "-5", "1.5", str(2**63)])
def test_a_tier_value_that_is_not_a_byte_count_is_named_and_left_out(bad: str) -> None:
    body = _lease("a")
    body["metadata"]["annotations"][names.ANNOTATION_TIERS] = (
        '{"cpu": {"capacityBytes": ' + bad + ', "usedBytes": 10}}')
    record = parse_lease(body)
    assert record is not None
    assert record.tiers == {"cpu": {"usedBytes": 10}}
    assert any("cpu.capacityBytes must be non-negative integers" in p for p in record.problems)
    assert cache_summary([_view(body)])["tiers"]["cpu"]["use"] == "-"


def test_a_lookup_count_above_int64_is_refused() -> None:
    record = parse_lease(_lease("a", lookups=_window(2**63, 0)))
    assert record is not None and record.lookups is None
    assert any("non-negative integers" in p for p in record.problems)

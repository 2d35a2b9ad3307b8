"""The Grafana dashboard queries only metrics of the contract (docs/contracts.md
section 6) that the agent really exports (node_agent.metrics.AgentMetrics), and
covers the views operators need."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.chart.render import CHART, REPO, Render

DASHBOARD_PATH = CHART / "dashboards" / "flexkv-agent.json"
DASHBOARD: dict[str, Any] = json.loads(DASHBOARD_PATH.read_text())
METRIC = re.compile(r"\bflexkv_agent_[a-z0-9_]+\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _contract_metrics() -> dict[str, str]:
    """name -> type from the table in section 6 of docs/contracts.md."""
    text = (REPO / "docs" / "contracts.md").read_text()
    section = text.split("## 6.", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|\s*`(flexkv_agent_[a-z0-9_]+)`\s*\|\s*([a-z]+)", section, re.MULTILINE)
    assert rows, "docs/contracts.md section 6 lists no metric"
    return dict(rows)


def _operator_metrics() -> dict[str, str]:
    """name -> type of what the operator itself exports (its own registry)."""
    from flexkv_operator.metrics import OperatorMetrics

    return {
        (f.name + "_total" if f.type == "counter" else f.name): f.type
        for f in OperatorMetrics().registry.collect()
    }


def _panels(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in node.get("panels", []):
        found.append(panel)
        found += _panels(panel)
    return found


def _exprs() -> list[str]:
    exprs = [t["expr"] for p in _panels(DASHBOARD) for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in DASHBOARD["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return exprs


def _queried() -> set[str]:
    return {m for e in _exprs() for m in METRIC.findall(e)}


def _family(sample: str, types: dict[str, str]) -> str | None:
    """The contract metric a queried series name belongs to, or None."""
    if sample in types:
        return sample
    for suffix in HISTOGRAM_SUFFIXES:
        base = sample.removesuffix(suffix)
        if base != sample and types.get(base) == "histogram":
            return base
    return None


def test_every_queried_metric_is_in_the_contract() -> None:
    types = _contract_metrics()
    unknown = sorted(m for m in _queried() if _family(m, types) is None)
    assert unknown == [], f"dashboard queries metrics outside contracts section 6: {unknown}"


def test_histograms_are_read_through_buckets_with_quantiles() -> None:
    types = _contract_metrics()
    for expr in _exprs():
        for name in METRIC.findall(expr):
            if types.get(name) == "histogram":
                raise AssertionError(f"histogram {name} queried without a suffix in {expr}")
            if name.endswith("_bucket"):
                assert "histogram_quantile(" in expr and "le" in expr, expr


def test_dashboard_covers_the_required_views() -> None:
    queried = _queried()
    required = {
        "flexkv_agent_hit_tokens_total",        # hit rate by tier
        "flexkv_agent_lookup_tokens_total",
        "flexkv_agent_transfer_bytes_total",    # bytes by direction
        "flexkv_agent_transfer_seconds_bucket",  # latencies from histograms
        "flexkv_agent_match_seconds_bucket",
        "flexkv_agent_engine_request_seconds_bucket",
        "flexkv_agent_tier_capacity_bytes",     # tier capacity / used
        "flexkv_agent_tier_used_bytes",
        "flexkv_agent_fanout_lag_seconds_bucket",  # fan-out lag
        "flexkv_agent_fanout_dropped_total",    # stale-epoch / gap drops
        "flexkv_agent_leader_changes_total",    # leader changes
    }
    assert required - queried == set()
    exprs = " ".join(_exprs())
    assert "by (tier)" in exprs and "by (direction" in exprs and "reason" in exprs


def test_dashboard_has_a_remote_tier_row() -> None:
    """The remote tier (Mooncake Store): up, hits, bytes by direction, queue depth,
    drops by reason, errors by operation, in a row of their own."""
    rows = [p for p in DASHBOARD["panels"] if p["type"] == "row"]
    [row] = [r for r in rows if "Remote tier" in r["title"]]
    panels = DASHBOARD["panels"]
    start = panels.index(row)
    end = next((i for i in range(start + 1, len(panels)) if panels[i]["type"] == "row"),
               len(panels))
    in_row = {t["expr"] for p in panels[start + 1:end] for t in p["targets"]}
    by_metric = {m: e for e in in_row for m in METRIC.findall(e)}
    assert set(by_metric) == {
        "flexkv_agent_remote_up",
        "flexkv_agent_remote_hit_blocks_total",
        "flexkv_agent_remote_bytes_total",
        "flexkv_agent_remote_queue_depth",
        "flexkv_agent_remote_dropped_blocks_total",
        "flexkv_agent_remote_errors_total",
    }
    assert "by (direction)" in by_metric["flexkv_agent_remote_bytes_total"]
    assert "by (reason)" in by_metric["flexkv_agent_remote_dropped_blocks_total"]
    assert "by (op)" in by_metric["flexkv_agent_remote_errors_total"]
    for name, expr in by_metric.items():
        if name.endswith("_total"):
            assert "rate(" in expr, expr


def test_every_queried_metric_is_exported_by_the_agent() -> None:
    metrics = pytest.importorskip("node_agent.metrics", reason="node_agent.metrics not importable")
    registry = metrics.AgentMetrics().registry
    exported: set[str] = set()
    for family in registry.collect():
        if family.type == "counter":
            exported.add(family.name + "_total")
        elif family.type == "histogram":
            exported |= {family.name + s for s in HISTOGRAM_SUFFIXES}
        else:
            exported.add(family.name)
    missing = sorted(_queried() - exported)
    assert missing == [], f"dashboard queries metrics AgentMetrics does not export: {missing}"


# Values Grafana substitutes for the dashboard's variables before querying.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$namespace": ".*",
    "$pool": ".*",
}


def _as_prometheus_sees_it(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def test_every_query_is_valid_promql_over_contract_metrics() -> None:
    """Each panel query parses as PromQL, and the metric names its selectors read
    (from the parsed tree, not a text search) are contract metrics."""
    promql = pytest.importorskip("promql_parser", reason="promql-parser (dev extra) missing")
    # The Operator row reads the operator's own metrics (docs/operator.md).
    types = {**_contract_metrics(), **_operator_metrics()}
    exprs = [t["expr"] for p in _panels(DASHBOARD) for t in p.get("targets", [])]
    assert exprs
    selected: set[str] = set()
    for expr in exprs:
        try:
            tree = promql.parse(_as_prometheus_sees_it(expr))
        except ValueError as e:
            raise AssertionError(f"invalid PromQL ({e}): {expr}") from None
        names: list[str] = []

        def visit(node: Any, names: list[str] = names) -> bool:
            if isinstance(node, promql.VectorSelector):
                names.append(node.name)
            return True

        promql.walk(tree, visit)
        assert names, f"query reads no metric: {expr}"
        selected.update(names)
    unknown = sorted(n for n in selected if _family(n, types) is None)
    assert unknown == [], f"queries select metrics outside the contract: {unknown}"


def test_dashboard_is_portable() -> None:
    """The data source is a variable, every panel uses it, and ids are unique."""
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(DASHBOARD)
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
    assert DASHBOARD["uid"] and DASHBOARD["title"]


def test_dashboard_configmap_is_opt_in_and_discoverable(renders: dict[str, Render]) -> None:
    assert not [
        c for c in renders["default"].of_kind("ConfigMap") if "grafana_dashboard" in
        c["metadata"].get("labels", {})
    ]
    config_map = renders["monitoring-values.yaml"].one("ConfigMap", namespace="monitoring")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "KV cache"}
    assert json.loads(config_map["data"]["flexkv-agent.json"]) == DASHBOARD

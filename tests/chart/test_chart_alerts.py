"""The chart's optional PrometheusRule: off by default, well formed, reading only
metrics the agent and operator export, accepted by promtool, each alert with a
runbook entry in docs/operations.md and promtool unit tests
(prometheus_rules_test.yaml) that fire it and keep it quiet."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.render import NAMESPACE, REPO, Render
from tests.observability.prometheus import require_binary

RULE_TESTS = Path(__file__).with_name("prometheus_rules_test.yaml")
OPERATIONS_DOC = REPO / "docs" / "operations.md"
ENABLED = ("--set", "monitoring.prometheusRule.enabled=true")
METRIC = re.compile(r"\bflexkv_(?:agent|operator)_[a-z0-9_]+\b")
DURATION = re.compile(r"^([0-9]+(ms|s|m|h))+$")
PROMTOOL_TIMEOUT_S = 120


def _exported() -> set[str]:
    """Every sample name the agent's and the operator's registries export."""
    from flexkv_operator.metrics import OperatorMetrics

    from node_agent.metrics import AgentMetrics

    names: set[str] = set()
    for registry in (AgentMetrics().registry, OperatorMetrics().registry):
        for family in registry.collect():
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
            else:
                names.add(family.name)
    return names


def _rule(render: Render) -> dict[str, Any]:
    return render.one("PrometheusRule")


def _alerts(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


@pytest.fixture
def enabled(render_with: Callable[..., Render]) -> dict[str, Any]:
    return _rule(render_with(*ENABLED, "--set", "monitoring.podMonitor.enabled=true"))


def test_the_prometheus_rule_is_off_by_default(renders: dict[str, Render]) -> None:
    for case, render in renders.items():
        if case != "monitoring-values.yaml":
            assert render.of_kind("PrometheusRule") == [], case
    rule = _rule(renders["monitoring-values.yaml"])
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_the_rendered_prometheus_rule_is_well_formed(render_with: Callable[..., Render]) -> None:
    render = render_with(*ENABLED, "--set", "monitoring.podMonitor.enabled=true")
    rule = _rule(render)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["app.kubernetes.io/name"] == "flexkv-operator"
    groups = rule["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups) >= 2
    exported = _exported()
    names = [a["alert"] for a in _alerts(rule)]
    assert len(set(names)) == len(names)
    for alert in _alerts(rule):
        name = alert["alert"]
        assert set(alert) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"FlexKV[A-Za-z]+", name), name
        assert isinstance(alert["expr"], str) and alert["expr"].strip(), name
        assert DURATION.match(alert.get("for", "0s")), name
        assert alert["labels"]["severity"] in {"warning", "critical"}, name
        notes = alert["annotations"]
        assert notes["summary"] and notes["description"], name
        assert notes["runbook_url"].endswith("docs/operations.md#" + name.lower()), name
        unknown = set(METRIC.findall(alert["expr"])) - exported
        assert unknown == set(), f"{name} reads metrics nobody exports: {unknown}"
    # `up` and the operator's Lease gauge are read by the chart's PodMonitor jobs.
    jobs = {f"{m['metadata']['namespace']}/{m['metadata']['name']}"
            for m in render.of_kind("PodMonitor")}
    read = {j for a in _alerts(rule) for j in re.findall(r'job="([^"]+)"', a["expr"])}
    assert read == jobs


def test_alert_settings_reach_the_rules(render_with: Callable[..., Render]) -> None:
    rule = _rule(render_with(
        *ENABLED, "--set", "monitoring.prometheusRule.labels.release=kps",
        "--set", "monitoring.prometheusRule.alertLabels.team=inference",
        "--set", "monitoring.prometheusRule.agentJob=kv-agents",
        "--set", "monitoring.prometheusRule.operatorJob=kv-operator",
        "--set", "monitoring.prometheusRule.ppGroupFor=3m",
        "--set", "monitoring.prometheusRule.runbookURL=https://runbooks.example/flexkv.html",
        "--set-json", "monitoring.prometheusRule.hitRateDropRatio=0.25"))
    assert rule["metadata"]["labels"]["release"] == "kps"
    alerts = {a["alert"]: a for a in _alerts(rule)}
    assert all(a["labels"]["team"] == "inference" for a in alerts.values())
    assert all(a["annotations"]["runbook_url"] ==
               f"https://runbooks.example/flexkv.html#{name.lower()}"
               for name, a in alerts.items())
    assert 'up{job="kv-agents"}' in alerts["FlexKVAgentDown"]["expr"]
    assert 'job="kv-operator"' in alerts["FlexKVOperatorNotLeading"]["expr"]
    assert alerts["FlexKVPPGroupWithoutLeader"]["for"] == "3m"
    assert alerts["FlexKVPPGroupDegraded"]["for"] == "3m"
    assert "< 0.25 *" in alerts["FlexKVHitRateCollapsed"]["expr"]


def test_every_alert_has_a_runbook_entry(enabled: dict[str, Any]) -> None:
    headings = set(re.findall(r"^### (FlexKV\w+)$", OPERATIONS_DOC.read_text(), re.M))
    names = {a["alert"] for a in _alerts(enabled)}
    assert names - headings == set(), "alerts without a runbook entry in docs/operations.md"
    assert headings - names == set(), "runbook entries of alerts the chart does not ship"


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = require_binary("promtool")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=PROMTOOL_TIMEOUT_S, check=False)


def test_promtool_accepts_the_rendered_rules(enabled: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": enabled["spec"]["groups"]}))
    out = _promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_alerts(enabled))} rules found" in out.stdout


def test_every_alert_fires_and_stays_quiet_in_promtool_unit_tests(
        enabled: dict[str, Any], tmp_path: Path) -> None:
    groups = enabled["spec"]["groups"]
    for group in groups:  # the unit tests check firing and labels, not the texts
        for alert in group["rules"]:
            alert.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    out = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout

    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for c in t["alert_rule_test"]]
    for name in (r["alert"] for g in groups for r in g["rules"]):
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"no promtool case fires {name}"
        assert any(not c["exp_alerts"] for c in mine), f"no promtool case keeps {name} quiet"

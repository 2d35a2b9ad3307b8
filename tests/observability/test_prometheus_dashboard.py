"""Every Grafana dashboard panel, evaluated by a real Prometheus that scraped a real
PP group of agents under client traffic and the real operator, returns at least
one series with a sane value.

Prometheus scrapes every second with the labels the chart's PodMonitors attach
(namespace, pod, pool, node). Grafana's variables are substituted as Grafana
would: ``$__rate_interval`` as Grafana computes it for a Prometheus data source
with its default 15 s scrape interval setting (4 x 15 s), ``$namespace`` and
``$pool`` both as "All" (their ``allValue``) and as the single value their own
``label_values`` queries list. All panels are evaluated at one instant, taken
after the last traffic was scraped.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from node_agent.demo.workload import WorkloadSpec
from tests.agent.harness import short_dir
from tests.observability.prometheus import (
    Prometheus,
    Target,
    finite,
    require_binary,
    scrape_config,
    series,
)
from tests.observability.scene import (
    NAMESPACE,
    POOL,
    AgentGroup,
    OperatorScene,
    free_port,
    run_engines,
)
from tests.remote.master import start_master
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "flexkv-operator"
DASHBOARD_PATH = CHART / "dashboards" / "flexkv-agent.json"
DASHBOARD: dict[str, Any] = json.loads(DASHBOARD_PATH.read_text())
RATE_INTERVAL = "1m"  # Grafana's $__rate_interval: max(interval + 15s, 4 x 15s) for short ranges
OPERATOR_NAMESPACE = "flexkv-system"
PANEL_TIMEOUT_S = 60.0
WORKLOAD = dict(conversations=6, turns=3, shared_prefixes=2, system_tokens=32,
                user_tokens=8, reply_tokens=8)


def _panels(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in node.get("panels", []):
        yield panel
        yield from _panels(panel)


PANELS = [p for p in _panels(DASHBOARD) if p["type"] != "row"]
TARGETS = [(p, t) for p in PANELS for t in p["targets"]]
VARIABLES = {v["name"]: v for v in DASHBOARD["templating"]["list"]}

# Panels whose every value is a fraction (ratios, 0/1 gauges).
FRACTIONS = {"Hit rate", "Hit rate by tier", "Tier use per agent", "Remote tier up",
             "PP role", "Active replica"}
# Panels of which at least one series must be above zero after the traffic.
POSITIVE = {"Ready agents", "Hit rate", "Stored tokens / s", "Hit rate by tier",
            "Lookup and hit tokens / s", "Transfer bandwidth by direction", "Transfer latency",
            "Match latency", "Engine request latency", "Engine requests by outcome",
            "Tier capacity and use", "Tier use per agent", "Evictions / s",
            "Remote hit blocks / s", "Remote bandwidth by direction", "Fan-out lag",
            "Leader epoch", "PP role", "Reconciles", "Failover latency", "Groups by phase",
            "Reconcile duration", "Active replica", "Remote tier up"}


def grafana_regex_value(values: list[str]) -> str:
    """How Grafana formats a query variable's selection inside a ``=~`` matcher."""
    escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, chosen: dict[str, str]) -> str:
    """``expr`` with every Grafana variable replaced; fails on one left over."""
    out = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name in sorted(chosen, key=len, reverse=True):
        out = out.replace("${" + name + "}", chosen[name]).replace("$" + name, chosen[name])
    assert "$" not in out, f"unknown Grafana variable in {expr}"
    return out


@dataclass
class Scene:
    prometheus: Prometheus
    at: float  # the instant every panel is evaluated at
    selections: dict[str, dict[str, str]]  # "all" / "single" -> variable -> value
    rules: bool  # whether the chart's alerting rules are loaded


def render_rules(work: Path) -> list[str]:
    """The chart's alerting rules as ``helm template`` renders them, selecting this
    Prometheus' job names, written to a rule file; [] when helm is not installed."""
    helm = shutil.which("helm") or str(REPO / ".tools" / "bin" / "helm")
    if not Path(helm).is_file():
        return []
    out = subprocess.run(
        [helm, "template", "kv", str(CHART), "--namespace", "flexkv-system",
         "--set", "monitoring.prometheusRule.enabled=true",
         "--set", "monitoring.prometheusRule.agentJob=agents",
         "--set", "monitoring.prometheusRule.operatorJob=operator",
         "--show-only", "templates/prometheusrule.yaml"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    rule = yaml.safe_load(out)
    path = work / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return [str(path)]


@pytest.fixture(scope="module")
def scene() -> Iterator[Scene]:
    binary = require_binary("prometheus")
    work = short_dir("obs")
    master = start_master(work / "master.log")
    group = AgentGroup(work, master)
    operator = OperatorScene(free_port())
    prometheus: Prometheus | None = None
    try:
        group.launch()  # the agents and the operator start side by side
        operator.start()
        group.wait_started()
        agents = [Target(f"127.0.0.1:{m['ports']['http']}",
                         {"namespace": NAMESPACE, "pod": f"flexkv-agent-{m['nodeName']}",
                          "pool": POOL, "node": m["nodeName"]}) for m in group.maps]
        op = Target(f"127.0.0.1:{operator.metrics_port}",
                    {"namespace": OPERATOR_NAMESPACE, "pod": "flexkv-operator-0"})
        rule_files = render_rules(work)
        prometheus = Prometheus(binary, work, free_port(),
                                scrape_config({"agents": agents, "operator": [op]},
                                              rule_files=rule_files))
        prometheus.start()
        prometheus.wait("count(up == 1)", lambda r: r and float(r[0]["value"][1]) == 3, 60,
                        "every target scraped")

        def move_leadership() -> None:
            """The operator moves the group's leadership: stage 1 leads at epoch 2."""
            wait_for(lambda: group.roles() == [("leader", 1), ("follower", 1)],
                     "stage 0 leading at epoch 1", 60, interval=0.1,
                     ignoring=(httpx.HTTPError,))
            group.publish(leader=1, epoch=2)
            wait_for(lambda: group.roles() == [("follower", 2), ("leader", 2)],
                     "stage 1 leading at epoch 2", 60, interval=0.1,
                     ignoring=(httpx.HTTPError,))

        run_engines(work, group, WorkloadSpec(**WORKLOAD, seed=1), "first",  # type: ignore[arg-type]
                    before_go=move_leadership)
        scraped_after(prometheus, time.time())
        run_engines(work, group, WorkloadSpec(**WORKLOAD, seed=2), "second")  # type: ignore[arg-type]
        operator.fail_over()
        prometheus.wait("flexkv_operator_failover_latency_seconds_count > 0", bool, 60,
                        "the failover observed by the operator scraped")
        at = scraped_after(prometheus, time.time())

        single = {name: prometheus.label_values(name, "flexkv_agent_ready")
                  for name in ("namespace", "pool")}
        assert single == {"namespace": [NAMESPACE], "pool": [POOL]}, single
        selections = {
            "all": {name: VARIABLES[name]["allValue"] for name in ("namespace", "pool")},
            "single": {name: grafana_regex_value(v) for name, v in single.items()},
        }
        for sel in selections.values():
            sel["datasource"] = "prometheus"
        yield Scene(prometheus, at, selections, bool(rule_files))
    finally:
        if prometheus is not None:
            prometheus.stop()
        operator.stop()
        group.stop()
        master.kill()
        shutil.rmtree(work, ignore_errors=True)


def scraped_after(prometheus: Prometheus, t: float) -> float:
    """Wait until every target was scraped after ``t``; returns the latest scrape time."""
    result = prometheus.wait(
        "min(timestamp(up))", lambda r: bool(r) and float(r[0]["value"][1]) > t, 60,
        "a scrape of every target after the last event")
    return float(result[0]["value"][1])


def test_the_sanity_checks_name_real_panels() -> None:
    titles = {p["title"] for p in PANELS}
    assert (FRACTIONS | POSITIVE) - titles == set()


def test_the_dashboard_variables_list_the_scraped_namespace_and_pool(scene: Scene) -> None:
    """Each ``label_values`` variable query, run as Grafana runs it, lists the scraped
    agents' values (the pool variable within the chosen namespace)."""
    for name in ("namespace", "pool"):
        query = VARIABLES[name]["query"]["query"]
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
        assert m, query
        match = substitute(m.group(1), scene.selections["single"])
        assert scene.prometheus.label_values(m.group(2), match) == [
            {"namespace": NAMESPACE, "pool": POOL}[name]]


@pytest.mark.parametrize("selection", ["all", "single"])
@pytest.mark.parametrize(
    ("panel", "target"), TARGETS,
    ids=[f"{p['title']}-{t.get('refId', i)}" for i, (p, t) in enumerate(TARGETS)])
def test_every_panel_query_returns_sane_series(
        scene: Scene, panel: dict[str, Any], target: dict[str, Any], selection: str) -> None:
    expr = substitute(target["expr"], scene.selections[selection])
    title = panel["title"]

    def sane(result: list[dict[str, Any]]) -> bool:
        if not finite(result):
            return False
        vals = [v for _, v in series(result)]
        if any(v < 0 for v in vals):
            return False
        if title in FRACTIONS and any(v > 1 for v in vals):
            return False
        return title not in POSITIVE or any(v > 0 for v in vals)

    result = scene.prometheus.wait(expr, sane, PANEL_TIMEOUT_S, f"panel {title!r}", at=scene.at)
    assert result and all(math.isfinite(v) for _, v in series(result))


def _instant(rfc3339: str) -> float:
    """Seconds since the epoch of a Prometheus API time (nanoseconds dropped)."""
    return datetime.fromisoformat(re.sub(r"\.\d+", "", rfc3339).replace("Z", "+00:00")).timestamp()


def test_the_alert_rules_evaluate_cleanly_on_the_scraped_series(scene: Scene) -> None:
    """The chart's rules, loaded into the same Prometheus, evaluate on the real
    series without errors, and the alerts of a healthy scene stay inactive."""
    if not scene.rules:
        pytest.skip("helm not found on PATH or in .tools/bin (run `make test` to fetch it)")

    def rules() -> list[dict[str, Any]]:
        body = scene.prometheus.http.get("/api/v1/rules").json()
        return [r for g in body["data"]["groups"] for r in g["rules"]]

    def evaluated_after_the_scene() -> bool:
        found = rules()
        return bool(found) and all(_instant(r["lastEvaluation"]) > scene.at for r in found)

    wait_for(evaluated_after_the_scene, "every rule evaluated", PANEL_TIMEOUT_S, interval=0.1,
             ignoring=(httpx.HTTPError,))
    found = {r["name"]: r for r in rules()}
    assert len(found) >= 10
    bad = {name: r.get("lastError") for name, r in found.items() if r["health"] != "ok"}
    assert bad == {}
    for quiet in ("FlexKVAgentDown", "FlexKVPPGroupWithoutLeader", "FlexKVRemoteTierDown",
                  "FlexKVFanoutMismatch", "FlexKVOperatorNotLeading"):
        assert found[quiet]["state"] == "inactive", (quiet, found[quiet]["alerts"])

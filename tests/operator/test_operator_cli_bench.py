"""The command line, the settings from the environment, and the benchmark's output shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from flexkv_operator.__main__ import parse_args
from flexkv_operator.context import OperatorSettings

REPO = Path(__file__).resolve().parents[2]


def test_flags() -> None:
    args = parse_args(["--namespace", "a", "-n", "b", "--liveness-port", "9000", "--verbose"])
    assert args.namespaces == ["a", "b"] and not args.all_namespaces
    assert args.liveness_port == 9000 and args.verbose
    assert parse_args(["--all-namespaces"]).all_namespaces
    assert parse_args(["-A"]).liveness_port == 8081


@pytest.mark.parametrize("argv", [[], ["--namespace", "a", "--all-namespaces"]])
def test_scope_is_required_and_exclusive(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_settings_from_environment() -> None:
    settings = OperatorSettings.from_env(
        {
            "FLEXKV_AGENT_IMAGE": "img:7",
            "FLEXKV_AGENT_SERVICE_ACCOUNT": "sa",
            "FLEXKV_OPERATOR_ID": "op-1",
        }
    )
    assert (settings.default_image, settings.service_account, settings.identity) == (
        "img:7",
        "sa",
        "op-1",
    )
    defaults = OperatorSettings.from_env({"POD_NAME": "operator-pod-x"})
    assert defaults.service_account == "flexkv-agent" and defaults.identity == "operator-pod-x"
    assert defaults.default_image == ""


def test_module_entry_point_prints_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flexkv_operator", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--all-namespaces" in out and "--liveness-port" in out


def test_bench_quick_prints_one_json_object_per_result() -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "bench" / "operator.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    lines = [json.loads(line) for line in completed.stdout.splitlines() if line.strip()]
    results = [r for r in lines if r["bench"] == "operator"]
    assert [r["agents"] for r in results] == [10, 100]
    for result in results:
        assert {
            "apply_to_ready_s",
            "failover_s",
            "failover_over_bound",
            "ready_per_agent_ms",
            "per_agent_ratio_vs_smallest",
            "groups",
        } <= set(result)
        assert result["groups"] == result["agents"] // 2
    assert lines[-1]["bench"] == "operator-summary"

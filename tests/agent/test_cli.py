"""The command line's helpers: Kubernetes mode selection and the log format."""

from __future__ import annotations

import logging

import pytest

from node_agent.__main__ import KeyValueFormatter, _kube_api, build_parser


def test_kubernetes_off_or_absent_means_no_api_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert _kube_api("off") is None
    assert _kube_api("auto") is None


def test_kubernetes_on_without_any_config_fails_loudly(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: object) -> None:
    from kubernetes.config import ConfigException

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    with pytest.raises(ConfigException):
        _kube_api("on")


def test_log_lines_carry_structured_fields() -> None:
    fmt = KeyValueFormatter("%(levelname)s %(message)s")
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "Engine API listening", (), None)
    rec.endpoint = "ipc:///tmp/e.sock"
    rec.count = 3
    assert fmt.format(rec) == 'INFO Engine API listening count=3 endpoint="ipc:///tmp/e.sock"'


def test_parser_requires_a_config_for_run() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run"])
    args = build_parser().parse_args(["run", "--config", "a.yaml"])
    assert (args.command, args.config) == ("run", "a.yaml")


def test_group_names_follow_the_operators_rule() -> None:
    from node_agent.contract.kube import group_name

    assert group_name("my-pool", "Llama_70B.0") == "my-pool-llama-70b-0"
    assert group_name("p", "x--") == "p-x"  # trailing dashes trimmed, inner ones kept
    assert len(group_name("p", "a" * 400)) == 253

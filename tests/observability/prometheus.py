"""A real Prometheus server on loopback for the observability tests, and the rule
that decides whether a missing Prometheus binary fails or skips a test.

Debian's ``prometheus`` package ships both ``prometheus`` and ``promtool``;
``scripts/test.sh`` installs it where the test command runs as root. In CI
(``CI=true``) as root a missing binary is a failure; elsewhere the test skips and
names the package to install.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


def require_binary(name: str) -> str:
    """The path of ``name`` (from Debian's ``prometheus`` package).

    Missing: fails the test when running as root with ``CI=true`` (the test
    command installs the package there), skips it with the reason elsewhere."""
    found = shutil.which(name)
    if found is not None:
        return found
    reason = (f"{name} not found on PATH: install Debian's 'prometheus' package "
              "(apt-get install -y prometheus; scripts/test.sh does this as root)")
    if os.environ.get("CI") == "true" and os.geteuid() == 0:
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass(frozen=True)
class Target:
    """One scrape target and the labels its PodMonitor would attach to it."""

    address: str
    labels: dict[str, str]


def scrape_config(jobs: dict[str, list[Target]], interval_s: float = 1.0,
                  rule_files: list[str] | None = None) -> dict[str, Any]:
    """A prometheus.yml scraping ``jobs`` (name -> targets) every ``interval_s``."""
    interval = f"{int(interval_s * 1000)}ms"
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval,
                   "evaluation_interval": interval},
        "rule_files": rule_files or [],
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics",
             "static_configs": [{"targets": [t.address], "labels": t.labels} for t in targets]}
            for job, targets in jobs.items()
        ],
    }


class Prometheus:
    """One ``prometheus`` process on 127.0.0.1 with its TSDB in ``work``."""

    def __init__(self, binary: str, work: Path, port: int, config: dict[str, Any]) -> None:
        self.binary = binary
        self.work = work
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.config_path = work / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log = work / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=10.0)

    def start(self) -> None:
        """Start the server and wait (bounded) until /-/ready answers 200."""
        out = self.log.open("ab")
        try:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.config_path}",
                 f"--web.listen-address=127.0.0.1:{self.port}",
                 f"--storage.tsdb.path={self.work / 'tsdb'}",
                 "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT)
        finally:
            out.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n"
                                     f"{self.log.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if self.http.get("/-/ready").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready within {START_TIMEOUT_S}s; "
                                     f"log {self.log}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a bound."""
        self.http.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one series) ``expr`` evaluates to at ``at``."""
        params: dict[str, str] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        r = self.http.get("/api/v1/query", params=params)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"Prometheus refused {expr!r}: {r.status_code} {body}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        if data["resultType"] != "vector":
            raise AssertionError(f"{expr!r} gave a {data['resultType']}, not an instant vector")
        result: list[dict[str, Any]] = data["result"]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's ``label_values(match, label)`` variable query lists."""
        r = self.http.get(f"/api/v1/label/{label}/values", params={"match[]": match})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", body
        values: list[str] = body["data"]
        return values

    def wait(self, expr: str, accept: Callable[[list[dict[str, Any]]], bool], timeout: float,
             what: str, at: float | None = None) -> list[dict[str, Any]]:
        """Poll ``expr`` until ``accept(result)``; fail with the last result after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr, at)
            if accept(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: {expr!r} gave {result} for {timeout}s")
            time.sleep(0.2)


def values(result: list[dict[str, Any]]) -> list[float]:
    """The sample values of an instant-vector result."""
    return [float(s["value"][1]) for s in result]


def finite(result: list[dict[str, Any]]) -> bool:
    """At least one series, and every value a finite number."""
    return bool(result) and all(math.isfinite(v) for v in values(result))


def series(result: list[dict[str, Any]]) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of each series."""
    for s in result:
        yield s["metric"], float(s["value"][1])

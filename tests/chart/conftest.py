"""Shared fixtures of the chart checks: the helm binary and one render per values file.

Every values file is rendered exactly once per test session (``helm template``
with ``--include-crds``); tests read the parsed objects from the session cache.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "flexkv-operator"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE = "kv"
NAMESPACE = "flexkv-system"
HELM_TIMEOUT_S = 60

HELM_DOC = REPO / "docs" / "helm.md"
# The oldest Kubernetes release the chart supports (Chart.yaml kubeVersion)
# and a pinned current release; both must be bundled by kubernetes-validate.
OLDEST_KUBE = "1.29.0"
CURRENT_KUBE = "1.37.0"

# Values files rendered by the `renders` fixture: the chart defaults (None)
# and every file of the chart's ci/ folder.
VALUES_CASES: list[str] = ["default", *(p.name for p in CI_VALUES)]


def find_helm() -> str | None:
    """The helm binary on PATH, else the repository's .tools/bin/helm, else None."""
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    local = REPO / ".tools" / "bin" / "helm"
    return str(local) if local.is_file() and os.access(local, os.X_OK) else None


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of the helm binary; skips the test when helm is not installed."""
    found = find_helm()
    if found is None:
        pytest.skip("helm binary not found on PATH or in .tools/bin (run `make test` to fetch it)")
    return found


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm with a bounded wait; on failure with check=True raise with its stderr."""
    proc = subprocess.run(
        [helm, *args], capture_output=True, text=True, timeout=HELM_TIMEOUT_S, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


@dataclass(frozen=True)
class Render:
    """The parsed objects of one ``helm template`` run."""

    case: str
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Every rendered object of ``kind``."""
        return [o for o in self.objects if o.get("kind") == kind]

    def one(
        self, kind: str, name: str | None = None, namespace: str | None = None
    ) -> dict[str, Any]:
        """The single object of ``kind`` (and name/namespace when given); fails otherwise."""
        found = [
            o
            for o in self.of_kind(kind)
            if (name is None or o["metadata"]["name"] == name)
            and (namespace is None or o["metadata"].get("namespace") == namespace)
        ]
        assert len(found) == 1, (
            f"{self.case}: expected one {kind} name={name} namespace={namespace}, "
            f"found {len(found)}"
        )
        return found[0]


def template(helm: str, *extra: str) -> list[dict[str, Any]]:
    """Render the chart with ``extra`` helm arguments and parse every document."""
    out = run_helm(
        helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds", *extra
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def values_args(case: str) -> list[str]:
    """helm arguments selecting the values file of ``case``."""
    return [] if case == "default" else ["--values", str(CHART / "ci" / case)]


@pytest.fixture(scope="session")
def renders(helm: str) -> dict[str, Render]:
    """One render per values case (chart defaults and each ci/ file), parsed."""
    return {case: Render(case, template(helm, *values_args(case))) for case in VALUES_CASES}


@pytest.fixture(scope="session")
def default_render(renders: dict[str, Render]) -> Render:
    """The render with the chart's default values."""
    return renders["default"]


@pytest.fixture(scope="session")
def chart_meta() -> dict[str, Any]:
    """Chart.yaml, parsed."""
    meta: dict[str, Any] = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return meta


@pytest.fixture
def render_with(helm: str) -> Iterator[Any]:
    """A function rendering the chart with extra ``--set``-style helm arguments."""

    def _render(*extra: str) -> Render:
        return Render("custom " + " ".join(extra), template(helm, *extra))

    yield _render


def doc_examples() -> list[dict[str, Any]]:
    """The flexkv.io objects shown in docs/helm.md's YAML blocks."""
    if not HELM_DOC.is_file():
        return []
    blocks = re.findall(r"```yaml\n(.*?)```", HELM_DOC.read_text(), flags=re.DOTALL)
    found = []
    for block in blocks:
        for doc in yaml.safe_load_all(block):
            if isinstance(doc, dict) and str(doc.get("apiVersion", "")).startswith("flexkv.io/"):
                found.append(doc)
    return found

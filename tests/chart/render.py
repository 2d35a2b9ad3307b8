"""Rendering the chart for its checks: the helm binary, one render per values file,
and the objects docs/helm.md shows."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

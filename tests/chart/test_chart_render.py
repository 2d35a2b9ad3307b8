"""The chart lints, renders for every values file, and every object is valid Kubernetes.

Built-in kinds are validated offline by kubernetes-validate in strict mode
(unknown fields are errors) for the oldest Kubernetes the chart supports and a
pinned current release. Custom resources are checked elsewhere: the chart's
KVCachePool against its CRD (test_chart_crds.py), the PodMonitor by shape here.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.chart.render import (
    CHART,
    CURRENT_KUBE,
    OLDEST_KUBE,
    VALUES_CASES,
    Render,
    run_helm,
    values_args,
)

CUSTOM_GROUPS = ("flexkv.io/", "monitoring.coreos.com/")


@pytest.mark.parametrize("case", VALUES_CASES)
def test_helm_lint_strict(helm: str, case: str) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), *values_args(case), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_validated_versions_are_bundled() -> None:
    from kubernetes_validate.utils import all_versions

    bundled = set(all_versions())
    assert {OLDEST_KUBE, CURRENT_KUBE} <= bundled, (
        f"kubernetes-validate {kubernetes_validate.__version__} bundles {sorted(bundled)}; "
        f"pin OLDEST_KUBE/CURRENT_KUBE to bundled releases"
    )


def test_kube_version_range_matches_oldest_validated(
    helm: str, chart_meta: dict[str, Any]
) -> None:
    """The chart installs on OLDEST_KUBE and refuses the release before it."""
    assert chart_meta["kubeVersion"] == f">={OLDEST_KUBE}-0"
    ok = run_helm(helm, "template", "x", str(CHART), "--kube-version", OLDEST_KUBE, check=False)
    assert ok.returncode == 0, ok.stderr
    major, minor, _ = OLDEST_KUBE.split(".")
    older = f"{major}.{int(minor) - 1}.0"
    refused = run_helm(helm, "template", "x", str(CHART), "--kube-version", older, check=False)
    assert refused.returncode != 0
    assert "incompatible with Kubernetes" in refused.stderr


@pytest.mark.parametrize("kube", [OLDEST_KUBE, CURRENT_KUBE])
@pytest.mark.parametrize("case", VALUES_CASES)
def test_every_builtin_object_is_valid_kubernetes(
    renders: dict[str, Render], case: str, kube: str
) -> None:
    objects = renders[case].objects
    builtin = [o for o in objects if not o["apiVersion"].startswith(CUSTOM_GROUPS)]
    assert builtin, f"{case}: nothing rendered"
    errors = []
    for obj in builtin:
        try:
            kubernetes_validate.validate(obj, kube, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
            name = f"{obj['kind']}/{obj['metadata'].get('name')}"
            errors.append(f"{name}: {getattr(e, 'message', e)}")
    assert errors == []


@pytest.mark.parametrize("case", VALUES_CASES)
def test_only_known_custom_resources_are_rendered(renders: dict[str, Render], case: str) -> None:
    custom = {
        (o["apiVersion"], o["kind"])
        for o in renders[case].objects
        if o["apiVersion"].startswith(CUSTOM_GROUPS)
    }
    assert custom <= {
        ("flexkv.io/v1alpha1", "KVCachePool"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("monitoring.coreos.com/v1", "PrometheusRule"),
    }


@pytest.mark.parametrize("case", VALUES_CASES)
def test_names_are_dns_labels_and_unique(renders: dict[str, Render], case: str) -> None:
    seen: set[tuple[str, str, str]] = set()
    for obj in renders[case].objects:
        meta = obj["metadata"]
        key = (obj["kind"], meta.get("namespace", ""), meta["name"])
        assert key not in seen, f"{case}: {key} rendered twice"
        seen.add(key)
        assert len(meta["name"]) <= 63, meta["name"]

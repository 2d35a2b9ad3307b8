"""The chart's CRDs are byte-identical copies of the operator's source of truth, and
every example KVCachePool (the chart's, docs/helm.md's) is valid under its CRD.

Custom resources are validated with jsonschema against the CRD's
openAPIV3Schema made strict: an object schema with properties and no
``additionalProperties`` / ``x-kubernetes-preserve-unknown-fields`` rejects
unknown fields, which the API server would otherwise prune silently.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from conftest import CHART, HELM_DOC, REPO, Render, doc_examples

SOURCE = REPO / "operator" / "flexkv_operator" / "crds"
CHART_CRDS = CHART / "crds"


def _source_files() -> list[str]:
    return sorted(p.name for p in SOURCE.glob("*.yaml")) if SOURCE.is_dir() else []


def _require_source() -> None:
    if not _source_files():
        pytest.skip(
            f"the operator's CRD source of truth ({SOURCE.relative_to(REPO)}/*.yaml) "
            "does not exist yet; re-run once it lands"
        )


def test_chart_carries_exactly_the_source_crds() -> None:
    _require_source()
    chart = sorted(p.name for p in CHART_CRDS.glob("*.yaml"))
    assert chart == _source_files(), (
        f"chart crds/ holds {chart}, the source {SOURCE.relative_to(REPO)} holds "
        f"{_source_files()}; copy the source files into {CHART_CRDS.relative_to(REPO)}"
    )


@pytest.mark.parametrize("name", _source_files() or ["<no source yet>"])
def test_chart_crd_is_byte_identical_to_the_source(name: str) -> None:
    _require_source()
    source = (SOURCE / name).read_bytes()
    copy_path = CHART_CRDS / name
    assert copy_path.is_file(), f"{copy_path.relative_to(REPO)} is missing; copy {name} there"
    assert copy_path.read_bytes() == source, (
        f"{copy_path.relative_to(REPO)} differs from {(SOURCE / name).relative_to(REPO)}; "
        "run: python scripts/sync_chart.py"
    )


def _crds() -> dict[str, dict[str, Any]]:
    """CRD manifests by kind, from the chart (identical to the source when it exists)."""
    out = {}
    for path in sorted(CHART_CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        out[crd["spec"]["names"]["kind"]] = crd
    return out


def _sync_chart() -> ModuleType:
    """scripts/sync_chart.py, which generates the chart's CRD copies and values schema."""
    spec = importlib.util.spec_from_file_location("sync_chart", REPO / "scripts" / "sync_chart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


strict_schema = _sync_chart().strict_schema


def validate_custom_resource(obj: dict[str, Any]) -> list[str]:
    """Errors of ``obj`` against its CRD's served version; [] when valid."""
    crd = _crds().get(obj["kind"])
    assert crd is not None, f"no CRD in the chart for kind {obj['kind']}"
    group, _, version = obj["apiVersion"].partition("/")
    assert group == crd["spec"]["group"], obj["apiVersion"]
    versions = {v["name"]: v for v in crd["spec"]["versions"] if v["served"]}
    assert version in versions, f"{obj['apiVersion']} is not served by {crd['metadata']['name']}"
    schema = strict_schema(versions[version]["schema"]["openAPIV3Schema"])
    # metadata is validated by the API server itself, not by the CRD schema.
    body = {k: v for k, v in obj.items() if k != "metadata"}
    validator = jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker())
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(body)]


def test_crds_are_served_structural_v1alpha1() -> None:
    crds = _crds()
    assert set(crds) == {"KVCachePool", "KVCacheGroup"}
    for crd in crds.values():
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        storage = [v for v in crd["spec"]["versions"] if v["storage"]]
        assert [v["name"] for v in storage] == ["v1alpha1"]
        assert storage[0]["subresources"] == {"status": {}}


def test_validator_rejects_what_the_api_server_would() -> None:
    """The strict CRD validator is real: bad and unknown fields are errors."""
    good: dict[str, Any] = {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "p"},
        "spec": {"tiers": {"cpu": {"size": "1Gi"}}},
    }
    assert validate_custom_resource(good) == []
    bad_backend = copy.deepcopy(good)
    bad_backend["spec"]["backend"] = "redis"
    assert any("backend" in e for e in validate_custom_resource(bad_backend))
    unknown = copy.deepcopy(good)
    unknown["spec"]["tiers"]["gpu"] = {"size": "1Gi"}
    assert any("gpu" in e for e in validate_custom_resource(unknown))
    no_tiers = copy.deepcopy(good)
    del no_tiers["spec"]["tiers"]
    assert any("tiers" in e for e in validate_custom_resource(no_tiers))


@pytest.mark.parametrize("case", ["example-pool-values.yaml", "multi-namespace-values.yaml"])
def test_chart_example_pool_is_valid(renders: dict[str, Render], case: str) -> None:
    pools = renders[case].of_kind("KVCachePool")
    assert len(pools) == 1
    assert validate_custom_resource(pools[0]) == []


def test_values_schema_of_example_pool_is_the_crd_spec_schema() -> None:
    """values.schema.json checks examplePool.spec with the CRD's own spec schema
    (made strict), so helm rejects an example pool the API server would reject."""
    values_schema = json.loads((CHART / "values.schema.json").read_text())
    in_values = values_schema["properties"]["examplePool"]["properties"]["spec"]
    crd = _crds()["KVCachePool"]
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert in_values == strict_schema(spec), (
        "values.schema.json examplePool.spec is out of date with the KVCachePool CRD; "
        "run python scripts/sync_chart.py"
    )


def test_docs_examples_are_valid_custom_resources() -> None:
    examples = doc_examples()
    assert examples, f"{HELM_DOC.relative_to(REPO)} shows no flexkv.io example to check"
    for example in examples:
        assert validate_custom_resource(example) == [], example["metadata"]["name"]

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

from tests.chart.render import CHART, HELM_DOC, REPO, Render, doc_examples

SOURCE = REPO / "operator" / "flexkv_operator" / "crds"


def _crds() -> dict[str, dict[str, Any]]:
    """CRD manifests by kind, from the operator's source of truth."""
    out = {}
    for path in sorted(SOURCE.glob("*.yaml")):
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


SYNC = _sync_chart()
strict_schema = SYNC.strict_schema


def test_generated_chart_files_match_the_crd_sources() -> None:
    """templates/crds/ and values.schema.json are what scripts/sync_chart.py makes now."""
    stale = [str(p.relative_to(REPO)) for p in SYNC.stale()]
    assert stale == [], f"{stale} are out of date with {SOURCE.relative_to(REPO)}; " \
                        "run: python scripts/sync_chart.py"
    assert not (CHART / "crds").exists(), "crds/ would install the CRDs a second time"


def test_rendered_crds_are_the_source_crds_with_chart_metadata(default_render: Render) -> None:
    crds = default_render.of_kind("CustomResourceDefinition")
    rendered = {o["metadata"]["name"]: o for o in crds}
    source = {c["metadata"]["name"]: c for c in _crds().values()}
    assert set(rendered) == set(source)
    for name, crd in source.items():
        got = rendered[name]
        assert {k: v for k, v in got.items() if k != "metadata"} == \
               {k: v for k, v in crd.items() if k != "metadata"}, name
        assert got["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert crd["metadata"].get("labels", {}).items() <= got["metadata"]["labels"].items()
        assert got["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_crd_switches(render_with: Any) -> None:
    assert render_with("--set", "crds.enabled=false").of_kind("CustomResourceDefinition") == []
    unkept = render_with("--set", "crds.keep=false").of_kind("CustomResourceDefinition")
    assert len(unkept) == 2
    assert all("annotations" not in c["metadata"] for c in unkept)


def test_generator_escapes_template_delimiters(tmp_path: Any) -> None:
    """A CRD text holding "{{" (a CEL rule, a description) renders back verbatim."""
    src = tmp_path / "x.yaml"
    src.write_text(yaml.safe_dump({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "xs.example.io"}, "spec": {"note": "a {{ b }} c"}}))
    text = SYNC.crd_template(src)
    assert "{{ `{{` }}" in text and "a {{ b }}" not in text


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


@pytest.mark.parametrize("case", ["example-pool-values.yaml", "multi-namespace-values.yaml",
                                  "several-replicas-values.yaml"])
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

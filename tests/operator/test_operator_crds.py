"""The CRDs: structure, defaults, schema and CEL validation of example and bad CRs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from flexkv_operator import crds
from flexkv_operator.defaults import apply_defaults

EXAMPLES = Path(__file__).parent / "examples"
REPO = Path(__file__).resolve().parents[2]


def _validator(plural: str) -> jsonschema.Validator:
    schema = crds.schema(plural)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema, format_checker=jsonschema.FormatChecker())


def _cel_rules(
    schema: dict[str, Any], path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], dict[str, str]]]:
    found = [(path, rule) for rule in schema.get("x-kubernetes-validations", [])]
    for key, sub in (schema.get("properties") or {}).items():
        found.extend(_cel_rules(sub, (*path, key)))
    return found


def cel_violations(plural: str, obj: dict[str, Any]) -> list[str]:
    """Evaluate every CEL rule of the CRD on the defaulted object, as the API server does."""
    schema = crds.schema(plural)
    defaulted = apply_defaults(obj, schema)
    env = celpy.Environment()
    messages = []
    for path, rule in _cel_rules(schema):
        node: Any = defaulted
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(node)})):
            messages.append(rule["message"])
    return messages


def schema_errors(plural: str, obj: dict[str, Any]) -> list[str]:
    defaulted = apply_defaults(obj, crds.schema(plural))
    return [e.message for e in _validator(plural).iter_errors(defaulted)]


def _pool(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "p"},
        "spec": {"tiers": {"cpu": {"size": "8Gi"}}, **spec},
    }


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    plural = crds.POOL_PLURAL if doc["kind"] == crds.POOL_KIND else crds.GROUP_PLURAL
    assert schema_errors(plural, doc) == []
    assert cel_violations(plural, doc) == []


def test_chart_example_pool_validates_if_present() -> None:
    values = REPO / "charts" / "flexkv-operator" / "values.yaml"
    if not values.exists():
        pytest.skip("chart not present")
    found = yaml.safe_load(values.read_text()).get("examplePool")
    if not isinstance(found, dict) or "spec" not in found:
        pytest.skip("chart has no examplePool.spec value")
    doc = _pool()
    doc["spec"] = found["spec"]
    assert schema_errors(crds.POOL_PLURAL, doc) == []


def test_crd_names_and_printer_columns() -> None:
    pool = crds.load_crd(crds.POOL_PLURAL)
    assert pool["spec"]["names"]["shortNames"] == ["kvp"]
    assert pool["spec"]["scope"] == "Namespaced"
    version = pool["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == ".status.readyAgents"
    assert columns["Groups"] == ".status.groupCount"
    assert columns["Phase"] == ".status.phase"
    assert columns["Age"] == ".metadata.creationTimestamp"
    group = crds.load_crd(crds.GROUP_PLURAL)
    assert group["spec"]["names"]["shortNames"] == ["kvg"]
    assert group["spec"]["versions"][0]["subresources"] == {"status": {}}


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for key, sub in (schema.get("properties") or {}).items():
        found.extend(_walk(sub, f"{path}.{key}"))
    if isinstance(schema.get("items"), dict):
        found.extend(_walk(schema["items"], f"{path}[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        found.extend(_walk(schema["additionalProperties"], f"{path}{{}}"))
    return found


@pytest.mark.parametrize("plural", [crds.POOL_PLURAL, crds.GROUP_PLURAL])
def test_schema_is_structural(plural: str) -> None:
    """Every node has a type (or is int-or-string / preserve-unknown), as apiextensions/v1 needs."""
    untyped = [
        path
        for path, node in _walk(crds.schema(plural))
        if "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert untyped == []


def test_status_declares_every_condition_type() -> None:
    conditions = crds.schema(crds.POOL_PLURAL)["properties"]["status"]["properties"]["conditions"]
    assert set(conditions["items"]["properties"]["type"]["enum"]) == {
        "Ready",
        "Progressing",
        "Degraded",
        "ConfigValid",
        "SizingValid",
    }
    assert set(conditions["items"]["properties"]) >= {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }


def test_defaults_fill_a_minimal_pool() -> None:
    spec = apply_defaults(_pool(), crds.schema(crds.POOL_PLURAL))["spec"]
    assert spec["backend"] == "embedded"
    assert spec["tokensPerBlock"] == 16
    assert spec["tiers"]["cpu"]["pinned"] is True
    assert spec["leaderElection"] == {
        "leaseDurationSeconds": 15,
        "renewDeadlineSeconds": 10,
        "retryPeriodSeconds": 2,
    }
    assert spec["agent"]["ports"] == {"http": 8080, "fanout": 5557}
    assert spec["eviction"] == {"policy": "lru", "highWatermark": 0.95, "lowWatermark": 0.85}


BAD_BY_SCHEMA = [
    ("unknown backend", {"backend": "redis"}),
    ("size not a quantity", {"tiers": {"cpu": {"size": "lots"}}}),
    ("size negative", {"tiers": {"cpu": {"size": -1}}}),
    ("cpu size missing", {"tiers": {"cpu": {}}}),
    ("tokensPerBlock zero", {"tokensPerBlock": 0}),
    ("port out of range", {"agent": {"ports": {"http": 70000}}}),
    ("relative ssd path", {"tiers": {"cpu": {"size": 1}, "ssd": {"size": "1Gi", "paths": ["x"]}}}),
    ("ssd without paths", {"tiers": {"cpu": {"size": 1}, "ssd": {"size": "1Gi"}}}),
    ("negative cacheEpoch", {"cacheEpoch": -1}),
    ("watermark above 1", {"eviction": {"highWatermark": 1.5}}),
]


@pytest.mark.parametrize("spec", [s for _, s in BAD_BY_SCHEMA], ids=[n for n, _ in BAD_BY_SCHEMA])
def test_schema_rejects_bad_specs(spec: dict[str, Any]) -> None:
    doc = _pool()
    doc["spec"].update(copy.deepcopy(spec))
    assert schema_errors(crds.POOL_PLURAL, doc) != []


BAD_BY_CEL = [
    (
        "lease not above renew",
        {"leaderElection": {"leaseDurationSeconds": 10, "renewDeadlineSeconds": 10}},
        "leaseDurationSeconds > renewDeadlineSeconds",
    ),
    (
        "renew not above retry",
        {"leaderElection": {"renewDeadlineSeconds": 2, "retryPeriodSeconds": 2}},
        "renewDeadlineSeconds > retryPeriodSeconds",
    ),
    (
        "watermarks inverted",
        {"eviction": {"lowWatermark": 0.9, "highWatermark": 0.8}},
        "lowWatermark must be below",
    ),
    ("same ports", {"agent": {"ports": {"http": 9000, "fanout": 9000}}}, "must differ"),
    (
        "fan-out wait not below the engine call",
        {"timeouts": {"engineCallSeconds": 5, "fanoutWaitSeconds": 5}},
        "fanoutWaitSeconds must be below",
    ),
    (
        "flexkv unpinned",
        {"backend": "flexkv", "tiers": {"cpu": {"size": "1Gi", "pinned": False}}},
        "pinned",
    ),
]


@pytest.mark.parametrize(
    ("spec", "message"), [(s, m) for _, s, m in BAD_BY_CEL], ids=[n for n, _, _ in BAD_BY_CEL]
)
def test_cel_rules_reject_cross_field_mistakes(spec: dict[str, Any], message: str) -> None:
    doc = _pool()
    doc["spec"].update(copy.deepcopy(spec))
    assert schema_errors(crds.POOL_PLURAL, doc) == []  # each field alone is fine
    violations = cel_violations(crds.POOL_PLURAL, doc)
    assert len(violations) == 1 and message in violations[0], violations


def test_cel_accepts_the_default_timings() -> None:
    assert cel_violations(crds.POOL_PLURAL, _pool()) == []

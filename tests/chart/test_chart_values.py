"""values.yaml and values.schema.json agree, every value is documented, and helm
rejects values that break the schema."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import yaml

from tests.chart.render import CHART, run_helm

VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES: dict[str, Any] = yaml.safe_load(VALUES_TEXT)
SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    """Follow a local ``$ref`` ("#/definitions/x") to its schema."""
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/definitions/"), f"unsupported $ref {ref}"
        node = SCHEMA["definitions"][ref.rsplit("/", 1)[1]]
    return node


def _key_paths(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Paths in ``value`` that ``schema`` does not declare.

    A key is declared when the schema node has it under ``properties``, or the
    node is a map schema (``additionalProperties`` is a schema) whose entries
    are then checked against that schema.
    """
    schema = _resolve(schema)
    missing: list[str] = []
    if not isinstance(value, dict):
        return missing
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    for key, sub in value.items():
        here = f"{path}.{key}" if path else key
        if key in props:
            missing += _key_paths(sub, props[key], here)
        elif isinstance(extra, dict):
            missing += _key_paths(sub, extra, here)
        else:
            missing.append(here)
    return missing


def _merge(base: Any, over: Any) -> Any:
    """Deep-merge ``over`` into ``base`` the way helm merges values files (maps only)."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {k: _merge(base.get(k), over[k]) if k in over else base[k] for k in base | over}
    return over


def test_every_value_has_a_schema_entry() -> None:
    assert _key_paths(VALUES, SCHEMA, "") == []


def test_schema_is_valid_draft7_and_accepts_the_defaults() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    errors = [e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(VALUES)]
    assert errors == []


@pytest.mark.parametrize("path", sorted((CHART / "ci").glob("*.yaml")), ids=lambda p: p.name)
def test_ci_values_files_match_the_schema(path: Any) -> None:
    """Each ci/ file, merged over the defaults as helm does, satisfies the schema."""
    data = yaml.safe_load(path.read_text())
    assert _key_paths(data, SCHEMA, "") == []
    merged = _merge(VALUES, data)
    errors = [e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(merged)]
    assert errors == []


KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w.-]*):(\s|$)")


def test_every_key_in_values_has_a_comment_above_it() -> None:
    """Each key line is preceded by a comment line (blank lines aside)."""
    undocumented = []
    previous = ""
    for number, line in enumerate(VALUES_TEXT.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        match = KEY_LINE.match(line)
        if match and not previous.startswith("#"):
            undocumented.append(f"line {number}: {match['key']}")
        previous = stripped
    assert undocumented == []


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--set", "image.pullPolicy=Sometimes"], "image.pullPolicy"),
        (["--set", "operator.livenessPort=80"], "operator.livenessPort"),
        (["--set", "operator.watch.namespaces[0]=Bad_Namespace"], "operator.watch.namespaces"),
        (["--set", "operator.watch.allNamespaces=yes"], "operator.watch.allNamespaces"),
        (["--set", "monitoring.podMonitor.interval=soon"], "monitoring.podMonitor.interval"),
        (["--set", "operator.replica=2"], "replica"),
        (["--set", "examplePool.spec.backend=redis"], "examplePool.spec.backend"),
        (["--set", "image.repository="], "image.repository"),
    ],
    ids=[
        "pull-policy",
        "privileged-port",
        "namespace-not-dns",
        "bool-as-string",
        "duration",
        "unknown-key",
        "backend",
        "empty-repository",
    ],
)
def test_helm_rejects_values_that_break_the_schema(
    helm: str, args: list[str], complaint: str
) -> None:
    proc = run_helm(helm, "template", "x", str(CHART), *args, check=False)
    assert proc.returncode != 0, f"helm accepted {args}"
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert complaint in proc.stderr, proc.stderr


def test_helm_rejects_a_values_file_that_breaks_the_schema(helm: str, tmp_path: Any) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(
        "operator:\n  watch:\n    namespaces: default\n"  # a string, not a list
        "monitoring:\n  podMonitor:\n    enabled: true\n    scrapeInterval: 5s\n"  # unknown key
    )
    proc = run_helm(helm, "template", "x", str(CHART), "--values", str(bad), check=False)
    assert proc.returncode != 0, "helm accepted a values file that breaks the schema"
    assert "operator.watch.namespaces" in proc.stderr, proc.stderr
    assert "scrapeInterval" in proc.stderr, proc.stderr

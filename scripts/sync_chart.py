"""Regenerate the chart's copies of the operator's CRDs.

The operator's ``operator/flexkv_operator/crds/*.yaml`` are the one source of
truth. This script turns each into a chart template,
``charts/flexkv-operator/templates/crds/<file>``: the same CRD behind
``crds.enabled``, with the chart's labels and, under ``crds.keep``, the
``helm.sh/resource-policy: keep`` annotation (so ``helm upgrade`` upgrades the
CRDs and ``helm uninstall`` leaves them and every custom resource in place). It
also rewrites ``examplePool.spec`` in ``values.schema.json`` as the KVCachePool
spec schema made strict (unknown fields rejected), so helm refuses an example
pool the API server would refuse. ``tests/chart/test_chart_crds.py`` fails until
this has been run after a CRD change.

Usage: python scripts/sync_chart.py            write the generated files
       python scripts/sync_chart.py --check    exit 1 naming stale files
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "operator" / "flexkv_operator" / "crds"
CHART = REPO / "charts" / "flexkv-operator"
CRD_TEMPLATES = CHART / "templates" / "crds"
# Label keys the chart's "flexkv-operator.labels" helper sets itself.
CHART_LABEL_KEYS = {
    "helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
    "app.kubernetes.io/version", "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of",
}


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` in which structural objects reject unknown fields."""
    result = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(result)
    return result


def pool_spec_schema() -> dict[str, Any]:
    """The KVCachePool CRD's ``spec`` schema, as the source of truth declares it."""
    crd = yaml.safe_load((SOURCE / "kvcachepools.flexkv.io.yaml").read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])


def _dump(data: Any, indent: int) -> str:
    """``data`` as block YAML indented by ``indent`` spaces, Helm delimiters escaped."""
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=10_000,
                          allow_unicode=True)
    # A literal "{{" in a description or CEL rule would be read as a template action.
    text = text.replace("{{", "{{ `{{` }}")
    pad = " " * indent
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


def crd_template(src: Path) -> str:
    """The chart template of the CRD in ``src``."""
    crd = yaml.safe_load(src.read_text())
    meta = crd["metadata"]
    unknown = set(meta) - {"name", "labels", "annotations"}
    if unknown:
        raise SystemExit(f"{src}: metadata keys {sorted(unknown)} are not carried into the "
                         "chart; extend scripts/sync_chart.py or drop them")
    extra_labels = {k: v for k, v in (meta.get("labels") or {}).items()
                    if k not in CHART_LABEL_KEYS}
    annotations = meta.get("annotations") or {}
    rel = src.relative_to(REPO) if src.is_relative_to(REPO) else src.name
    lines = [
        f"{{{{- /* Generated from {rel} by scripts/sync_chart.py; do not edit. */}}}}",
        "{{- if .Values.crds.enabled }}",
        f"apiVersion: {crd['apiVersion']}",
        f"kind: {crd['kind']}",
        "metadata:",
        f"  name: {meta['name']}",
        "  labels:",
        '    {{- include "flexkv-operator.labels" . | nindent 4 }}',
    ]
    if extra_labels:
        lines.append(_dump(extra_labels, 4).rstrip("\n"))
    if annotations:
        lines += ["  annotations:", _dump(annotations, 4).rstrip("\n"),
                  "    {{- if .Values.crds.keep }}", "    helm.sh/resource-policy: keep",
                  "    {{- end }}"]
    else:
        lines += ["  {{- if .Values.crds.keep }}", "  annotations:",
                  "    helm.sh/resource-policy: keep", "  {{- end }}"]
    rest = {k: v for k, v in crd.items() if k not in ("apiVersion", "kind", "metadata")}
    lines += [_dump(rest, 0).rstrip("\n"), "{{- end }}", ""]
    return "\n".join(lines)


def generated() -> dict[Path, str]:
    """Every generated file and its wanted content."""
    out = {CRD_TEMPLATES / src.name: crd_template(src) for src in sorted(SOURCE.glob("*.yaml"))}
    values_path = CHART / "values.schema.json"
    values = json.loads(values_path.read_text())
    values["properties"]["examplePool"]["properties"]["spec"] = strict_schema(pool_spec_schema())
    out[values_path] = json.dumps(values, indent=2) + "\n"
    return out


def stale() -> list[Path]:
    """Generated files that differ from what the sources give, and leftover CRD templates."""
    wanted = generated()
    changed = [p for p, text in wanted.items() if not p.is_file() or p.read_text() != text]
    extra = [p for p in sorted(CRD_TEMPLATES.glob("*.yaml")) if p not in wanted]
    return changed + extra


def sync() -> list[Path]:
    """Write every generated file, remove CRD templates without a source; the paths touched."""
    wanted = generated()
    CRD_TEMPLATES.mkdir(parents=True, exist_ok=True)
    touched = []
    for path in stale():
        if path in wanted:
            path.write_text(wanted[path])
        else:
            path.unlink()
        touched.append(path)
    return touched


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        out_of_date = stale()
        for path in out_of_date:
            print(f"Stale: {path.relative_to(REPO)}; run python scripts/sync_chart.py",
                  file=sys.stderr)
        sys.exit(1 if out_of_date else 0)
    for path in sync():
        print(f"Wrote {path.relative_to(REPO)}")

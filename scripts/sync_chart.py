"""Regenerate the chart's copies of the operator's CRDs.

The operator's ``operator/flexkv_operator/crds/*.yaml`` are the one source of
truth. This script copies them byte for byte into ``charts/flexkv-operator/crds/``
and rewrites ``examplePool.spec`` in ``values.schema.json`` as the KVCachePool
spec schema made strict (unknown fields rejected), so helm refuses an example pool
the API server would refuse. ``tests/chart/test_chart_crds.py`` fails until this
has been run after a CRD change.

Usage: python scripts/sync_chart.py
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "operator" / "flexkv_operator" / "crds"
CHART = REPO / "charts" / "flexkv-operator"


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


def sync() -> list[Path]:
    """Copy the CRDs and rewrite the values schema; returns the files written."""
    written = []
    for src in sorted(SOURCE.glob("*.yaml")):
        dest = CHART / "crds" / src.name
        shutil.copyfile(src, dest)
        written.append(dest)
    values_path = CHART / "values.schema.json"
    values = json.loads(values_path.read_text())
    values["properties"]["examplePool"]["properties"]["spec"] = strict_schema(pool_spec_schema())
    values_path.write_text(json.dumps(values, indent=2) + "\n")
    written.append(values_path)
    return written


if __name__ == "__main__":
    for path in sync():
        print(f"Wrote {path.relative_to(REPO)}")

"""The chart's README is what `helm show readme` prints, names every top-level
value, and shows a KVCachePool the CRD accepts; NOTES.txt points at it."""

from __future__ import annotations

import re

import yaml
from test_chart_crds import validate_custom_resource

from tests.chart.render import CHART, run_helm


def test_helm_show_readme_prints_the_chart_readme(helm: str) -> None:
    out = run_helm(helm, "show", "readme", str(CHART)).stdout
    assert out.strip() == (CHART / "README.md").read_text().strip()
    assert out.startswith("# flexkv-operator")


def test_readme_names_every_top_level_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table = (CHART / "README.md").read_text().split("## Values", 1)[1]
    missing = [key for key in values if f"`{key}" not in table]
    assert missing == [], f"README.md's values table lacks {missing}"


def test_readme_example_pool_is_valid() -> None:
    text = (CHART / "README.md").read_text()
    pools = [doc for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
             for doc in yaml.safe_load_all(block)
             if isinstance(doc, dict) and doc.get("kind") == "KVCachePool"]
    assert len(pools) == 1
    assert validate_custom_resource(pools[0]) == []


def test_notes_point_at_the_packaged_readme() -> None:
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "docs/helm.md" not in notes, "docs/ is not in the chart package"
    assert "helm show readme" in notes

"""The objects the operator renders for a pool under the chart's settings (its
image and ServiceAccount as the chart's Deployment hands them to it), for the
checks that hold them to what the chart promises."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart.render import Render

children = pytest.importorskip("flexkv_operator.children", reason="operator not importable")
names = pytest.importorskip("flexkv_operator.names", reason="operator not importable")
spec_module = pytest.importorskip("flexkv_operator.spec", reason="operator not importable")

def _without_nulls(value: Any) -> Any:
    """Drop null fields, as the API server does with a JSON null in a create."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def operator_env(render: Render) -> dict[str, str]:
    deployment = render.one("Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if "value" in e}


def agent_children(render: Render, pool: dict[str, Any]) -> list[dict[str, Any]]:
    """What the operator creates for ``pool`` under the chart's settings."""
    env = operator_env(render)
    body = {**pool, "metadata": {**pool["metadata"], "uid": "00000000-0000-0000-0000-000000000001"}}
    identity = children.PoolIdentity(
        name=pool["metadata"]["name"],
        namespace=pool["metadata"]["namespace"],
        owner=names.owner_reference(body),
    )
    config = spec_module.parse_pool_spec(pool["spec"], default_image=env["FLEXKV_AGENT_IMAGE"])
    rendered = children.render_all(identity, config, env["FLEXKV_AGENT_SERVICE_ACCOUNT"])
    return [_without_nulls(obj) for obj in rendered]

"""Shared fixtures of the chart checks: the helm binary and one render per values file.

Every values file is rendered exactly once per test session (``helm template``
with ``--include-crds``); tests read the parsed objects from the session cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.chart.render import (
    CHART,
    VALUES_CASES,
    Render,
    find_helm,
    template,
    values_args,
)


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of the helm binary; skips the test when helm is not installed."""
    found = find_helm()
    if found is None:
        pytest.skip("helm binary not found on PATH or in .tools/bin (run `make test` to fetch it)")
    return found


@pytest.fixture(scope="session")
def renders(helm: str) -> dict[str, Render]:
    """One render per values case (chart defaults and each ci/ file), parsed."""
    return {case: Render(case, template(helm, *values_args(case))) for case in VALUES_CASES}


@pytest.fixture(scope="session")
def default_render(renders: dict[str, Render]) -> Render:
    """The render with the chart's default values."""
    return renders["default"]


@pytest.fixture(scope="session")
def chart_meta() -> dict[str, Any]:
    """Chart.yaml, parsed."""
    meta: dict[str, Any] = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return meta


@pytest.fixture
def render_with(helm: str) -> Iterator[Any]:
    """A function rendering the chart with extra ``--set``-style helm arguments."""

    def _render(*extra: str) -> Render:
        return Render("custom " + " ".join(extra), template(helm, *extra))

    yield _render

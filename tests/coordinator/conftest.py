"""Fixtures of the coordinator suite: a started one-stage group, an in-process
two-stage group (:class:`~tests.coordinator.pairs.InProcessGroup`) and a group of
three stage processes (:class:`~tests.coordinator.procs.Group`).

A module tunes the two-stage group with ``pytestmark =
pytest.mark.pair_options(**kwargs)`` (keyword arguments of ``InProcessGroup``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from node_agent.coordinator import Coordinator
from node_agent.metrics import AgentMetrics
from node_agent.pp.auth import CurveKeys
from tests.coordinator.harness import Buffers, single_stage
from tests.coordinator.pairs import InProcessGroup
from tests.coordinator.procs import Group


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "pair_options(**kwargs): keyword arguments of the `pair` fixture's "
        "InProcessGroup (timeouts, cpu_blocks, max_pending)")


@pytest.fixture
def single() -> Iterator[tuple[Coordinator, Buffers]]:
    """Rank 0 leading a one-stage group (real embedded backend, metrics on), and
    its engine buffers."""
    with single_stage(metrics=AgentMetrics()) as stage:
        yield stage


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[InProcessGroup]:
    """Two connectors of one group in this process, rank 0 leading epoch 1, both
    ready; options from the closest ``pair_options`` marker."""
    options = request.node.get_closest_marker("pair_options")
    with InProcessGroup(2, **(options.kwargs if options else {})) as group:
        yield group


@pytest.fixture
def group() -> Iterator[Group]:
    """Three stage processes over Curve-authenticated sockets, rank 0 leading
    epoch 1, every stage ready."""
    g = Group(3, CurveKeys.generate(), cpu_blocks=32)
    try:
        g.publish_view(1, 0)
        g.wait_ready()
        yield g
    finally:
        g.close()

"""Fixtures of the agent tests: the emulated Kubernetes API (tests/support/kube_api.py,
the one the operator's tests use) and a ``kubernetes`` client pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from kubernetes import client as k8s

from tests.support.kube_api import ApiServer, api_server


@pytest_asyncio.fixture()
async def kube() -> AsyncIterator[ApiServer]:
    """A running emulated API server with the bundled resources and the flexkv.io kinds."""
    async with api_server() as server:
        yield server


@pytest.fixture()
def kube_api(kube: ApiServer) -> Iterator[k8s.ApiClient]:
    """A ``kubernetes`` API client talking to the emulator."""
    conf = k8s.Configuration()
    conf.host = str(kube.url).rstrip("/")
    api = k8s.ApiClient(conf)
    try:
        yield api
    finally:
        api.close()

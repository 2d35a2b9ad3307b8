"""Fixtures of the agent tests: a short work directory per test, the emulated
Kubernetes API (tests/support/kube_api.py, the one the operator's tests use) and a
``kubernetes`` client pointed at it."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from kubernetes import client as k8s

from tests.agent.harness import short_dir
from tests.support.kube_api import ApiServer, api_server


@pytest.fixture()
def work(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A short directory of the test's own (agent configs, sockets, logs), named after
    its module and removed after it. A module that needs more in it (CURVE keys)
    overrides this fixture and asks for it."""
    d = short_dir(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


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

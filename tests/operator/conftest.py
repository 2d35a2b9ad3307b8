"""Fixtures for the operator tests: an emulated API server per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tests.support.kube_api import ApiServer, api_server


@pytest_asyncio.fixture
async def api() -> AsyncIterator[ApiServer]:
    async with api_server() as server:
        yield server

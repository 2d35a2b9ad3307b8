"""Fixtures for the operator tests: an emulated API server per test."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

sys.path.insert(0, str(Path(__file__).parent))

from flexkv_apiserver import ApiServer
from flexkv_harness import api_server


@pytest_asyncio.fixture
async def api() -> AsyncIterator[ApiServer]:
    async with api_server() as server:
        yield server

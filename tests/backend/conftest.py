"""Fixtures of the backend tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.backend.cpu_tier import read_only_fd
from node_agent.backend.tier_fds import TierFdServer


@pytest.fixture()
def sock_dir() -> Iterator[Path]:
    """A short directory of the test's own for Unix sockets (paths are limited to
    107 bytes, which pytest's ``tmp_path`` may exceed); removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="fkv-b-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture()
def tier_server(sock_dir: Path) -> Iterator[TierFdServer]:
    """A started tier socket of this process's shared tiers (what the agent serves
    at ``<engineSocket>.tier``); closed afterwards."""
    server = TierFdServer(str(sock_dir / "e.sock.tier"), read_only_fd)
    server.start()
    yield server
    server.close()

"""Fixtures of the backend tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture()
def sock_dir() -> Iterator[Path]:
    """A short directory of the test's own for Unix sockets (paths are limited to
    107 bytes, which pytest's ``tmp_path`` may exceed); removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="fkv-b-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)

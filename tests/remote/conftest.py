"""A real ``mooncake_master`` on loopback for the remote tier tests (the ``master``
fixture; the process itself is :class:`tests.remote.master.Master`).

When the ``remote`` extra or Debian's ``libibverbs1`` is missing these tests FAIL
(they do not skip): ``make test`` installs both (scripts/bootstrap.sh, as root).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.remote.master import Master, start_master


@pytest.fixture(scope="session", autouse=True)
def mooncake_importable() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the remote tier tests need Mooncake: {exc}; run bash scripts/bootstrap.sh "
                    "(installs the remote extra and, as root, Debian's libibverbs1)")


@pytest.fixture
def master(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Master]:
    """A master for this test alone. ``@pytest.mark.master_lease_ms(N)`` on a test
    that removes objects it read gives them an N ms read lease instead of
    Mooncake's 10 s, so the removal does not wait that long."""
    lease = request.node.get_closest_marker("master_lease_ms")
    m = start_master(tmp_path / "master.log", lease_ms=None if lease is None else lease.args[0])
    try:
        yield m
    finally:
        with contextlib.suppress(Exception):
            m.kill()

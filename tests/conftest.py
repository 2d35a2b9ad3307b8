"""Session-wide clean-up shared by every test package."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

_TIER = re.compile(r"^flexkv-tier-[0-9a-f]+-(\d+)-\d+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="session", autouse=True)
def _remove_killed_agents_tiers() -> Iterator[None]:
    """Agents the tests kill (SIGKILL) leave their shared CPU tier segments in
    /dev/shm; a restarted agent on the same socket removes them, a test's next
    agent (on a fresh socket) does not. At the end of the session, remove those
    whose creating process is gone."""
    yield
    shm = Path("/dev/shm")
    with contextlib.suppress(OSError):
        for entry in shm.iterdir():
            m = _TIER.match(entry.name)
            if m and not _alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    entry.unlink()

"""Which pool an SSD directory belongs to: one pool's agents per directory at a time.

Every SSD tier of an agent of pool ``P`` (and the agent itself, from its start)
holds a shared ``flock`` on ``flexkv-owner.lock`` in each of its directories,
whose content names ``P``. A claim by pool ``Q`` while an agent of ``P`` holds
the lock is refused with :class:`SsdPathInUse` naming ``P``: two pools whose
``tiers.ssd.paths`` overlap by mistake never share (or clobber) each other's
files. Once no agent of ``P`` holds it (all stopped or died: the kernel drops the
lock with the process), the directory passes to the next pool that claims it;
``P``'s files there are never served to it (a persistent tier's files name their
pool, :mod:`.ssd_format`) and are reclaimed slot by slot as its tiers need them.

The check runs under an exclusive ``flock`` of ``flexkv-owner.guard``, held only
while claiming, so two agents starting together cannot both take the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Sequence
from pathlib import Path

OWNER_NAME = "flexkv-owner.lock"
GUARD_NAME = "flexkv-owner.guard"


class SsdPathInUse(ValueError):
    """An SSD directory is held by an agent of another pool."""


class DirectoryOwner:
    """Shared ownership of ``paths`` (directories) by ``pool`` until :meth:`close`."""

    def __init__(self, paths: Sequence[str], pool: str) -> None:
        self.pool = pool
        self._fds: list[int] = []
        try:
            for d in dict.fromkeys(Path(p).resolve() for p in paths):
                d.mkdir(parents=True, exist_ok=True)
                self._fds.append(_claim(d, pool))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the directories (closing the fds drops the locks)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _claim(d: Path, pool: str) -> int:
    """Hold ``d``'s owner lock shared for ``pool``; returns its fd."""
    guard = os.open(d / GUARD_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)  # held only by claims, each a few syscalls
        fd = os.open(d / OWNER_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            owner = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                alone = False  # agents hold it: they are of the pool the file names
            if not alone and owner != pool:
                raise SsdPathInUse(
                    f"SSD directory {d} is in use by pool {owner!r} (an agent of that pool "
                    f"holds it); pool {pool!r} cannot share it: give each pool its own "
                    "tiers.ssd.paths"
                )
            if owner != pool:
                os.ftruncate(fd, 0)
                os.pwrite(fd, pool.encode(), 0)
            fcntl.flock(fd, fcntl.LOCK_SH)
            return fd
        except BaseException:
            os.close(fd)
            raise
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(guard, fcntl.LOCK_UN)
        os.close(guard)

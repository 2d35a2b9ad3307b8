"""The SSD tier: preallocated block files, one per configured directory.

Block ``i`` lives in file ``i % len(paths)`` at offset ``(i // len(paths)) *
bytes_per_block``, its bytes in region order (plane after plane, the CPU tier's
segments concatenated), so a spill or a load is one ``pwritev`` / ``preadv`` per
block straight from or into the CPU pool or a staging tensor.

Several tiers may share directories (an agent serving several PP stages, or a
leader and a follower in one test): each open tier claims a *slot*, the lowest
number whose lock file ``flexkv-tier-<slot>.lock`` it can ``flock`` in every
directory, and names its files ``flexkv-blocks-<slot>-<i>.bin``. The kernel drops
the lock when the process dies, so a restarted agent reclaims (and truncates) the
same files instead of leaking new ones.

Restart behaviour: the files are recreated (truncated and preallocated) when the
tier opens. The tier has no persistent index, so nothing cached on SSD survives an
agent restart; a PP group's stages could not agree on surviving content anyway,
and ``cacheEpoch`` flushes rely on a restart being a flush.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "flexkv-blocks-{slot}-{index}.bin"
LOCK_NAME = "flexkv-tier-{slot}.lock"
#: Tiers that may share one set of directories.
MAX_SLOTS = 64


class SsdTier:
    """``num_blocks`` blocks of ``bytes_per_block`` bytes striped over files in ``paths``."""

    def __init__(self, bytes_per_block: int, num_blocks: int, paths: Sequence[str]) -> None:
        self.bytes_per_block = bytes_per_block
        self.num_blocks = num_blocks
        self.files: list[Path] = []
        self._fds: list[int] = []
        self._locks: list[int] = []
        self.slot = -1
        if not num_blocks:
            return
        per_file = -(-num_blocks // len(paths)) * bytes_per_block
        try:
            self.slot = self._claim_slot(paths)
            for i, directory in enumerate(paths):
                d = Path(directory)
                f = d / FILE_NAME.format(slot=self.slot, index=i)
                fd = os.open(f, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                self._fds.append(fd)
                self.files.append(f)
                try:
                    os.posix_fallocate(fd, 0, per_file)
                except OSError as e:
                    raise OSError(
                        e.errno,
                        f"cannot preallocate {per_file} bytes in {f}: {e.strerror}; free space "
                        "or lower tiers.ssd.size",
                    ) from e
        except BaseException:
            self.close()
            raise
        log.info("SSD tier opened", extra={"files": [str(f) for f in self.files],
                                           "blocks": num_blocks})

    def _claim_slot(self, paths: Sequence[str]) -> int:
        """Lock the lowest slot free in every directory; keeps the lock fds open."""
        dirs = list(dict.fromkeys(Path(p).resolve() for p in paths))
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        for slot in range(MAX_SLOTS):
            fds: list[int] = []
            for d in dirs:
                fd = os.open(d / LOCK_NAME.format(slot=slot), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    break
                fds.append(fd)
            if len(fds) == len(dirs):
                self._locks = fds
                return slot
            for fd in fds:
                os.close(fd)
        raise OSError(
            f"all {MAX_SLOTS} SSD tier slots in {[str(d) for d in dirs]} are held by open "
            "tiers; give this tier its own tiers.ssd.paths or close the others"
        )

    def _where(self, index: int) -> tuple[int, int]:
        n = len(self._fds)
        return self._fds[index % n], (index // n) * self.bytes_per_block

    def write(self, index: int, buffers: Sequence[memoryview]) -> None:
        """Write block ``index`` from ``buffers`` (its segments, in region order)."""
        fd, offset = self._where(index)
        done = os.pwritev(fd, buffers, offset)
        if done != self.bytes_per_block:
            raise OSError(
                f"short write to SSD block {index}: {done} of {self.bytes_per_block} bytes"
            )

    def read(self, index: int, buffers: Sequence[memoryview]) -> None:
        """Read block ``index`` into ``buffers`` (its segments, in region order)."""
        fd, offset = self._where(index)
        done = os.preadv(fd, buffers, offset)
        if done != self.bytes_per_block:
            raise OSError(
                f"short read of SSD block {index}: {done} of {self.bytes_per_block} bytes"
            )

    def read_block(self, index: int) -> bytes:
        """The raw bytes of block ``index``."""
        fd, offset = self._where(index)
        return os.pread(fd, self.bytes_per_block, offset)

    def close(self) -> None:
        """Close the files (they stay on disk until the next open truncates them)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        for fd in self._locks:  # closing the fd releases the flock
            os.close(fd)
        self._locks.clear()

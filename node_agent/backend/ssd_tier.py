"""The SSD tier: preallocated block files, one per configured directory.

Block ``i`` lives in file ``i % len(paths)`` at offset ``(i // len(paths)) *
bytes_per_block``, its bytes in region order (plane after plane, the CPU tier's
segments concatenated), so a spill or a load is one ``pwritev`` / ``preadv`` per
block straight from or into the CPU pool or a staging tensor.

Restart behaviour: the files are recreated (truncated and preallocated) when the
tier opens. The tier has no persistent index, so nothing cached on SSD survives an
agent restart; a PP group's stages could not agree on surviving content anyway,
and ``cacheEpoch`` flushes rely on a restart being a flush.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "flexkv-blocks-{index}.bin"


class SsdTier:
    """``num_blocks`` blocks of ``bytes_per_block`` bytes striped over files in ``paths``."""

    def __init__(self, bytes_per_block: int, num_blocks: int, paths: Sequence[str]) -> None:
        self.bytes_per_block = bytes_per_block
        self.num_blocks = num_blocks
        self.files: list[Path] = []
        self._fds: list[int] = []
        if not num_blocks:
            return
        per_file = -(-num_blocks // len(paths)) * bytes_per_block
        try:
            for i, directory in enumerate(paths):
                d = Path(directory)
                d.mkdir(parents=True, exist_ok=True)
                f = d / FILE_NAME.format(index=i)
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

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

Restart behaviour: without ``identity`` the files are recreated (truncated and
preallocated) when the tier opens, and nothing cached on SSD survives an agent
restart. With ``identity`` (a *persistent* tier, ``tiers.ssd.persist``) the tier
also keeps a records file (:mod:`.ssd_format`): each spill writes the block's
bytes, then a record naming its hash, its parent's hash and its checksum. A tier
opening with the same identity (pool, model namespace, layout, hash algorithm,
``cacheEpoch``, size and directories) takes the slot whose header names it,
keeps its files and verifies them (:mod:`.ssd_recovery`): :attr:`recovered` is
what the index is rebuilt from. Slot choice: the lowest free slot whose header
names this identity; else the lowest free slot within the SSD budget (below
``budget_slots``, the number of tiers ``tiers.ssd.size`` is split into) holding
no saved blocks (no intact records header), else the lowest free saved slot
within the budget, else the same outside it. The files of the slot taken are
truncated: a tier that does not persist (a PP stage, a stage without a model
identity) never truncates a persistent tier's saved files while a slot without
any is free within the budget, so registration order after a restart does not
lose them; a saved slot is reclaimed (and logged) only when the budget leaves no
other, which is the rule by which an old epoch's, model's or pool's files are
cleaned. A records file is rewritten for a new ``cacheEpoch``
by :meth:`reset_records` (a flush).

With a ``pool`` every tier also holds its directories for that pool
(:mod:`.ssd_owner`): a tier of another pool is refused while it is open.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from node_agent.backend.ssd_format import (
    HEADER_BYTES,
    RECORD,
    RECORD_BYTES,
    RECORDS_NAME,
    HeaderError,
    TierIdentity,
    block_checksum,
    decode_header,
    decode_records,
    encode_header,
    encode_record,
)
from node_agent.backend.ssd_owner import DirectoryOwner
from node_agent.backend.ssd_recovery import Recovery, recover

log = logging.getLogger(__name__)

FILE_NAME = "flexkv-blocks-{slot}-{index}.bin"
LOCK_NAME = "flexkv-tier-{slot}.lock"
#: Tiers that may share one set of directories.
MAX_SLOTS = 64


class SsdTier:
    """``num_blocks`` blocks of ``bytes_per_block`` bytes striped over files in ``paths``.

    ``identity`` makes the tier persistent (see the module docstring; ``hash_bytes``
    is the width of its block hashes); ``pool`` claims the directories for that pool;
    ``budget_slots`` is the number of tiers the node's SSD budget is split into
    (1: this tier's size is all of it; slot choice, :meth:`_claim_slot`).
    """

    def __init__(self, bytes_per_block: int, num_blocks: int, paths: Sequence[str],
                 identity: TierIdentity | None = None, hash_bytes: int = 8,
                 pool: str = "", budget_slots: int = 1) -> None:
        self.bytes_per_block = bytes_per_block
        self.num_blocks = num_blocks
        self.files: list[Path] = []
        self._fds: list[int] = []
        self._locks: list[int] = []
        self.slot = -1
        self.identity = identity
        self.hash_bytes = hash_bytes
        #: Blocks with a record (not checked yet) when a persistent tier reopened its
        #: files; :meth:`verify` checks them, and nothing may write them before.
        self.recorded: list[int] = []
        self._raw_records = b""
        self._records_fd = -1
        # Write sequence numbers start at the wall clock in ns: every record of this
        # run is newer than every record of an earlier run (each took more than 1 ns).
        self._seq = time.time_ns()
        self._sums: dict[int, int] = {}
        self._digest = identity.digest() if identity is not None else b""
        self._owner: DirectoryOwner | None = None
        if not num_blocks:
            return
        per_file = -(-num_blocks // len(paths)) * bytes_per_block
        try:
            owner = pool or (identity.pool if identity is not None else "")
            if owner:
                self._owner = DirectoryOwner(paths, owner)
            self.slot, keep = self._claim_slot(paths, budget_slots)
            flags = os.O_RDWR | os.O_CREAT | (0 if keep else os.O_TRUNC)
            for i, directory in enumerate(paths):
                d = Path(directory)
                f = d / FILE_NAME.format(slot=self.slot, index=i)
                fd = os.open(f, flags, 0o600)
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
            if identity is not None:
                self._open_records(Path(paths[0]), keep)
        except BaseException:
            self.close()
            raise
        log.info("SSD tier opened", extra={"files": [str(f) for f in self.files],
                                           "blocks": num_blocks,
                                           "persistent": identity is not None,
                                           "recorded": len(self.recorded)})

    def _records_path(self, directory: Path, slot: int) -> Path:
        return directory / RECORDS_NAME.format(slot=slot)

    def _header(self, directory: Path, slot: int) -> dict[str, object] | None:
        """The identity fields slot ``slot``'s records header names (None: no
        records file, or not an intact header: nothing saved there)."""
        try:
            with open(self._records_path(directory, slot), "rb") as f:
                return decode_header(f.read(HEADER_BYTES))
        except (OSError, HeaderError, ValueError):
            return None

    @staticmethod
    def _lock_slot(dirs: Sequence[Path], slot: int) -> list[int] | None:
        """``slot``'s lock fds in every directory, or None when an open tier holds it."""
        fds: list[int] = []
        for d in dirs:
            fd = os.open(d / LOCK_NAME.format(slot=slot), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                for held in fds:
                    os.close(held)
                return None
            fds.append(fd)
        return fds

    def _claim_slot(self, paths: Sequence[str], budget_slots: int) -> tuple[int, bool]:
        """Lock a slot free in every directory (keeping the lock fds open).

        A persistent tier takes the lowest free slot whose header names its
        identity (then True: its files are kept). Otherwise the lowest free slot
        by, in order: within the SSD budget (slot below ``budget_slots``, the
        number of tiers the node's ``tiers.ssd.size`` is split into), then holding
        no saved blocks (no intact records header), so a tier never truncates
        another tier's saved files while a slot without any is free within the
        budget. A saved slot taken anyway is logged, and its records file removed
        by a tier that does not persist."""
        dirs = list(dict.fromkeys(Path(p).resolve() for p in paths))
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        first = Path(paths[0])
        want = decode_header(encode_header(self.identity)) if self.identity is not None else None
        best: tuple[tuple[bool, bool], int, list[int]] | None = None
        for slot in range(MAX_SLOTS):
            header = self._header(first, slot)
            match = want is not None and header == want
            rank = (slot >= budget_slots, header is not None)
            if not match and best is not None and best[0] <= rank:
                continue  # no better than the slot held; do not create its lock files
            fds = self._lock_slot(dirs, slot)
            if fds is None:
                continue
            if best is not None:
                for fd in best[2]:
                    os.close(fd)
            if match:
                self._locks = fds
                return slot, True
            best = (rank, slot, fds)
            if want is None and rank == (False, False):
                break  # nothing ranks higher for a tier that does not persist
        if best is None:
            raise OSError(
                f"all {MAX_SLOTS} SSD tier slots in {[str(d) for d in dirs]} are held by open "
                "tiers; give this tier its own tiers.ssd.paths or close the others"
            )
        (over_budget, saved), slot, self._locks = best
        if saved:
            log.warning("SSD tier takes a slot holding saved blocks; they are dropped",
                        extra={"slot": slot, "budget_slots": budget_slots,
                               "over_budget": over_budget})
            if self.identity is None:
                self._records_path(first, slot).unlink(missing_ok=True)
        return slot, False

    def _open_records(self, directory: Path, keep: bool) -> None:
        """Open (``keep``: and verify) or create the records file of a persistent tier."""
        assert self.identity is not None
        path = self._records_path(directory, self.slot)
        size = HEADER_BYTES + self.num_blocks * RECORD_BYTES
        self._records_fd = fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if keep:
            raw = os.pread(fd, size - HEADER_BYTES, HEADER_BYTES).ljust(size - HEADER_BYTES,
                                                                       b"\0")
            used = np.frombuffer(raw, dtype=RECORD, count=self.num_blocks)["magic"] != b""
            self.recorded = np.flatnonzero(used).tolist()
            self._raw_records = raw
        else:
            self._write_header()
        os.ftruncate(fd, size)

    def _write_header(self) -> None:
        """A fresh records file: no record, then this tier's header."""
        assert self.identity is not None
        fd = self._records_fd
        os.ftruncate(fd, 0)  # every record is gone before the header names the identity
        os.ftruncate(fd, HEADER_BYTES + self.num_blocks * RECORD_BYTES)
        os.pwrite(fd, encode_header(self.identity), 0)

    def verify(self, stop: Callable[[], bool] = lambda: False) -> Recovery:
        """Decode the records of :attr:`recorded` and read back and check their blocks
        (:func:`.ssd_recovery.recover`).

        The caller keeps those blocks from being written until this returns (the
        index holds them reserved); ``stop()`` ends the scan early
        (:class:`~.ssd_recovery.RecoveryStopped`)."""
        records, bad = decode_records(self._raw_records, self._digest, self.hash_bytes)
        self._raw_records = b""
        found = recover(records, bad, self.bytes_per_block, self._read_into, stop)
        log.info("SSD tier verified", extra={
            "blocks": len(found.blocks), "dropped": found.dropped,
            "bytes_verified": found.bytes_verified, "seconds": round(found.seconds, 3)})
        return found

    def _read_into(self, index: int, buffer: memoryview) -> int:
        fd, offset = self._where(index)
        return os.preadv(fd, [buffer], offset)

    @property
    def persistent(self) -> bool:
        """True when the tier keeps a records file."""
        return self._records_fd >= 0

    def reset_records(self, cache_epoch: int) -> None:
        """Forget every record and name ``cache_epoch`` in the header (a flush): a
        later start recovers only blocks written after this call."""
        if self.identity is None or not self.persistent:
            return
        self.identity = replace(self.identity, cache_epoch=cache_epoch)
        self._digest = self.identity.digest()
        self._sums.clear()
        self.recorded, self._raw_records = [], b""
        self._write_header()

    def _where(self, index: int) -> tuple[int, int]:
        n = len(self._fds)
        return self._fds[index % n], (index // n) * self.bytes_per_block

    def write(self, index: int, buffers: Sequence[memoryview]) -> None:
        """Write block ``index`` from ``buffers`` (its segments, in region order).

        A persistent tier keeps the bytes' checksum for the block's :meth:`record`."""
        fd, offset = self._where(index)
        done = os.pwritev(fd, buffers, offset)
        if done != self.bytes_per_block:
            raise OSError(
                f"short write to SSD block {index}: {done} of {self.bytes_per_block} bytes"
            )
        if self._records_fd >= 0:
            self._sums[index] = block_checksum(list(buffers))

    def record(self, index: int, block_hash: int, parent: int | None) -> None:
        """Record that block ``index`` (just written) holds ``block_hash``, whose parent
        is ``parent`` (None for a chain head). No-op unless persistent."""
        if self._records_fd < 0:
            return
        checksum = self._sums.pop(index, None)
        if checksum is None:
            raise ValueError(f"SSD block {index} has no write to record; write it first")
        rec = encode_record(self._seq, checksum, block_hash, parent, self.hash_bytes,
                            self._digest)
        self._seq += 1
        done = os.pwrite(self._records_fd, rec, HEADER_BYTES + index * RECORD_BYTES)
        if done != RECORD_BYTES:
            raise OSError(f"short write of the record of SSD block {index}: {done} bytes")

    def sync(self) -> None:
        """Flush the files to the device (a clean stop of a persistent tier)."""
        for fd in [*self._fds, *([self._records_fd] if self._records_fd >= 0 else [])]:
            os.fdatasync(fd)

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
        """Close the files (a persistent tier syncs them first; a non-persistent tier's
        stay on disk until the next open truncates them)."""
        if self._records_fd >= 0:
            try:
                self.sync()
            except OSError as e:
                log.error("SSD tier sync failed at close", extra={"error": str(e)})
            os.close(self._records_fd)
            self._records_fd = -1
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        for fd in self._locks:  # closing the fd releases the flock
            os.close(fd)
        self._locks.clear()
        if self._owner is not None:
            self._owner.close()
            self._owner = None

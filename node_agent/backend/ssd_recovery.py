"""Recovery of a persistent SSD tier's blocks at start: verify, deduplicate, order by chain.

:func:`recover` takes the intact records of a tier whose header names this
tier's identity (:mod:`.ssd_format`) and keeps a block only when

1. its bytes, read back from the block file, hash to the record's XXH3-128
   (else dropped as ``checksum``: a torn or half-written block, or a record
   older than the bytes under it);
2. it is the newest verified copy of its hash (else ``duplicate``);
3. its parent (the previous block of its prefix chain) is kept too, recursively
   up to a chain head (else ``orphan``: without its prefix it could never be a
   hit, and the index never holds a block whose parent it lacks).

The kept blocks come back parents first, so the index can be rebuilt as the
same prefix tree (:meth:`~.index.BlockIndex.restore`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from node_agent.backend.ssd_format import DROP_REASONS, Record


@dataclass
class Recovery:
    """What a persistent tier found on disk at start."""

    blocks: list[Record] = field(default_factory=list)
    """Verified blocks, parents before children."""
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    """Blocks found and not recovered, by reason (:data:`~.ssd_format.DROP_REASONS`)."""
    bytes_verified: int = 0
    """Block bytes read back and checksummed."""
    seconds: float = 0.0
    """Time the scan took."""


class RecoveryStopped(Exception):
    """The scan was stopped (the tier is closing or was flushed); nothing is recovered."""


def recover(records: list[Record], bad_records: int, bytes_per_block: int,
            read_into: Callable[[int, memoryview], int],
            stop: Callable[[], bool] = lambda: False) -> Recovery:
    """Verify ``records`` (``bad_records`` more were torn or foreign); ``read_into(block,
    buffer)`` reads a block's bytes into ``buffer`` and returns how many it read.
    Raises :class:`RecoveryStopped` as soon as ``stop()`` is true (checked per block)."""
    t0 = time.perf_counter()
    out = Recovery()
    out.dropped["record"] = bad_records
    buf = bytearray(bytes_per_block)
    view = memoryview(buf)
    newest: dict[int, Record] = {}
    for r in records:
        if stop():
            raise RecoveryStopped
        got = read_into(r.block, view)
        out.bytes_verified += got
        if got != bytes_per_block or xxhash.xxh3_128_intdigest(view) != r.checksum:
            out.dropped["checksum"] += 1
            continue
        old = newest.get(r.hash)
        if old is not None:
            out.dropped["duplicate"] += 1
            if old.seq > r.seq:
                continue
        newest[r.hash] = r
    children: dict[int, list[Record]] = {}
    heads: list[Record] = []
    for r in newest.values():
        if r.parent is None:
            heads.append(r)
        else:
            children.setdefault(r.parent, []).append(r)
    order = heads
    i = 0
    while i < len(order):  # breadth first: every parent before its children
        order.extend(children.get(order[i].hash, ()))
        i += 1
    out.blocks = order
    out.dropped["orphan"] = len(newest) - len(order)
    out.seconds = time.perf_counter() - t0
    return out

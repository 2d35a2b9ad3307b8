"""The object format of the remote tier: a header, then the block's bytes.

An object is :data:`HEADER_BYTES` of header followed by the block's bytes in
region order (``segments(0)[b] + segments(1)[b] + ...``). The header, little-endian:

========  ===============================================================
bytes     field
========  ===============================================================
0..3      magic ``FKVO``
4..5      object format version (:data:`.keys.FORMAT_VERSION`)
6..7      0
8..23     the block digest (:func:`.keys.block_digest`, 128 bits)
24..31    the writer: a random id of the stage tier that wrote it (not 0)
32..39    XXH3-64 of the block bytes that follow the header
40..63    0
========  ===============================================================

A fetched object is used only when its header names this format, the digest its
key was derived from, and the checksum of the bytes that follow it
(:func:`verify`), so bytes that are not this block's (an object overwritten under
its key, a segment reused by another client, a torn copy) are never published.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import xxhash

from node_agent.backend.remote.keys import FORMAT_VERSION

HEADER_BYTES = 64
MAGIC = b"FKVO"
_U64 = (1 << 64) - 1
HEADER = np.dtype([("magic", "S4"), ("version", "<u2"), ("flags", "<u2"),
                   ("digest_lo", "<u8"), ("digest_hi", "<u8"), ("writer", "<u8"),
                   ("checksum", "<u8"), ("pad", "V24")])
assert HEADER.itemsize == HEADER_BYTES

#: Why a fetched object was refused (the ``reason`` label of
#: ``flexkv_agent_remote_rejected_blocks_total``).
REASONS = ("size", "format", "digest", "checksum", "writer")


def new_writer_id() -> int:
    """A random, non-zero 63-bit writer id (one per stage tier incarnation)."""
    return secrets.randbits(63) or 1


def _headers(area: np.ndarray, n: int, object_bytes: int) -> np.ndarray:
    """The headers of the first ``n`` objects of ``area`` (uint8, objects back to
    back), as a strided structured view (writes go to ``area``)."""
    return np.ndarray((n,), dtype=HEADER, buffer=area, strides=(object_bytes,))


def _checksums(area: np.ndarray, n: int, object_bytes: int) -> list[int]:
    mv = memoryview(area.data)
    f = xxhash.xxh3_64_intdigest
    return [f(mv[i * object_bytes + HEADER_BYTES:(i + 1) * object_bytes]) for i in range(n)]


def write_headers(area: np.ndarray, slots: Sequence[int], object_bytes: int,
                  digests: Sequence[int], writer: int) -> None:
    """Fill the headers of the objects at ``slots`` of ``area`` (their block bytes
    are already in place) with ``digests`` (same order), ``writer`` and each
    object's checksum."""
    if not len(slots):
        return
    heads = _headers(area, max(slots) + 1, object_bytes)
    mv = memoryview(area.data)
    f = xxhash.xxh3_64_intdigest
    for i, d in zip(slots, digests, strict=True):
        h = heads[i]
        h["magic"], h["version"], h["flags"] = MAGIC, FORMAT_VERSION, 0
        h["digest_lo"], h["digest_hi"] = d & _U64, (d >> 64) & _U64
        h["writer"] = writer
        h["checksum"] = f(mv[i * object_bytes + HEADER_BYTES:(i + 1) * object_bytes])


def verify(area: np.ndarray, n: int, object_bytes: int, digests: Sequence[int],
           writer: int | None) -> tuple[int, str | None, int | None]:
    """Check the first ``n`` objects of ``area`` against the ``digests`` their keys
    came from. Returns ``(good, reason, writer)``: how many objects from the first
    are this block's bytes and were written by one writer (``writer``, or when it
    is None the first object's), why the next one was refused (None when all
    ``n`` are good) and the run's writer."""
    if n == 0:
        return 0, None, writer
    heads = _headers(area, n, object_bytes)
    d = np.asarray(digests[:n], dtype=object)
    lo = np.array([int(x) & _U64 for x in d], dtype=np.uint64)
    hi = np.array([(int(x) >> 64) & _U64 for x in d], dtype=np.uint64)
    fmt = (heads["magic"] == MAGIC) & (heads["version"] == FORMAT_VERSION)
    dig = (heads["digest_lo"] == lo) & (heads["digest_hi"] == hi)
    bad = ~(fmt & dig)
    limit = int(bad.argmax()) if bad.any() else n
    sums = _checksums(area, limit, object_bytes)
    stored = heads["checksum"][:limit].tolist()
    good = 0
    while good < limit and sums[good] == stored[good]:
        good += 1
    reason: str | None = None
    if good < limit:
        reason = "checksum"
    elif limit < n:
        reason = "format" if not fmt[limit] else "digest"
    if good:
        writers = heads["writer"][:good]
        if writer is None:
            writer = int(writers[0])
        other = writers != np.uint64(writer)
        if other.any():
            good, reason = int(other.argmax()), "writer"
    return good, reason, writer

"""The on-disk format of a persistent SSD tier: an identity header and one record per block.

A persistent tier (``tiers.ssd.persist``) keeps, next to its block files, one
*records file* ``flexkv-records-<slot>.bin`` in its first directory:

* bytes ``0 .. HEADER_BYTES``: the **header**, naming what the files hold
  (:class:`TierIdentity`: pool, hash namespace (the stage's model), layout,
  bytes per block, hash algorithm, ``cacheEpoch``, block count and directories)
  as canonical JSON, with its digest and an XXH3-64 of the header itself;
* then :data:`RECORD_BYTES` per SSD block ``i`` at ``HEADER_BYTES + i *
  RECORD_BYTES``: the **record** of the block last written there.

A record (little-endian):

========  ===============================================================
bytes     field
========  ===============================================================
0..3      magic ``FKVR``
4..5      format version (:data:`VERSION`)
6         hash width in bytes (8, 16 or 32)
7         flags: bit 0 set when the block has a parent (is not a chain head)
8..15     write sequence number (older writes have lower numbers)
16..31    XXH3-128 of the block's bytes (the block file's bytes, region order)
32..63    the block hash (little-endian, zero-padded)
64..95    the parent block's hash (zero for a chain head)
96..111   the identity digest of the tier that wrote it
112..119  0
120..127  XXH3-64 of bytes 0..119
========  ===============================================================

A spill writes the block's bytes first and its record second, so a crash
between the two leaves a record whose checksum does not match the bytes (or an
older record's), and a crash inside either write leaves a checksum or record
check that fails: recovery (:mod:`.ssd_recovery`) serves a block only when its
record is intact, names this tier's identity and its bytes hash to the recorded
checksum. Nothing is ``fsync``-ed per block; a clean stop syncs the files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import xxhash

from node_agent.backend.hashing import HashAlgorithm

if TYPE_CHECKING:
    from node_agent.backend.config import EmbeddedBackendConfig

#: The records file of tier slot ``slot`` (in the tier's first directory).
RECORDS_NAME = "flexkv-records-{slot}.bin"
VERSION = 1
HEADER_BYTES = 4096
RECORD_BYTES = 128
HEADER_MAGIC = b"FKVS"
RECORD_MAGIC = b"FKVR"
_U64 = (1 << 64) - 1

RECORD = np.dtype([
    ("magic", "S4"), ("version", "<u2"), ("hash_bytes", "u1"), ("flags", "u1"),
    ("seq", "<u8"), ("sum_lo", "<u8"), ("sum_hi", "<u8"),
    ("hash", "V32"), ("parent", "V32"), ("identity", "V16"), ("pad", "V8"),
    ("check", "<u8"),
])
assert RECORD.itemsize == RECORD_BYTES

#: Why a block found on disk at start was not recovered (the ``reason`` label of
#: ``flexkv_agent_recovered_dropped_blocks_total``): ``record`` a torn or foreign
#: record, ``checksum`` bytes that do not match their record (a torn or
#: half-written block), ``duplicate`` an older copy of a block recorded twice,
#: ``orphan`` a block whose parent was not recovered (its prefix is gone: it could
#: never be a hit).
DROP_REASONS = ("record", "checksum", "duplicate", "orphan")


@dataclass(frozen=True)
class TierIdentity:
    """What a persistent tier's files hold; blocks are recovered only by a tier
    whose identity is equal in every field."""

    pool: str
    namespace: str
    """The stage's block-hash namespace (its model identity and the pool's salt)."""
    layout: str
    """The stage's ``KVLayout`` (every field: shape, dtype, tokens per block, TP)."""
    bytes_per_block: int
    hash_algorithm: str
    cache_epoch: int
    num_blocks: int
    paths: tuple[str, ...]

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces)."""
        return json.dumps({"version": VERSION, **asdict(self)}, sort_keys=True,
                          separators=(",", ":")).encode()

    def digest(self) -> bytes:
        """16 bytes, equal exactly when every field is equal."""
        return hashlib.blake2b(self.to_json(), digest_size=16).digest()


#: Bytes of a block hash per algorithm (a record's hash width).
HASH_BYTES = {HashAlgorithm.XXH3_64: 8, HashAlgorithm.XXH3_128: 16, HashAlgorithm.BLAKE2B: 32}


def tier_identity(config: EmbeddedBackendConfig) -> TierIdentity:
    """The identity of the persistent SSD tier ``config`` describes."""
    lay = config.layout
    layout = ",".join(f"{f.name}={getattr(getattr(lay, f.name), 'value', getattr(lay, f.name))}"
                      for f in fields(lay))
    return TierIdentity(
        pool=config.pool, namespace=config.namespace or "", layout=layout,
        bytes_per_block=lay.bytes_per_block, hash_algorithm=config.hash_algorithm.value,
        cache_epoch=config.cache_epoch, num_blocks=config.ssd_blocks,
        paths=tuple(str(Path(p).resolve()) for p in config.ssd_paths),
    )


class HeaderError(ValueError):
    """A records file whose header is missing, torn or of another format."""


def encode_header(identity: TierIdentity) -> bytes:
    """The :data:`HEADER_BYTES` header naming ``identity``."""
    body = identity.to_json()
    head = HEADER_MAGIC + VERSION.to_bytes(2, "little") + b"\0\0" + identity.digest() \
        + len(body).to_bytes(4, "little") + body
    if len(head) + 8 > HEADER_BYTES:
        raise ValueError(
            f"the SSD tier's identity takes {len(head)} bytes, more than the {HEADER_BYTES}-byte "
            "header holds; use fewer or shorter tiers.ssd.paths"
        )
    head = head.ljust(HEADER_BYTES - 8, b"\0")
    return head + xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")


def decode_header(raw: bytes) -> dict[str, object]:
    """The identity fields a header names; :class:`HeaderError` when it is not an
    intact header of this format."""
    if len(raw) < HEADER_BYTES:
        raise HeaderError(f"header is {len(raw)} bytes, expected {HEADER_BYTES}")
    head, check = raw[:HEADER_BYTES - 8], int.from_bytes(raw[HEADER_BYTES - 8:HEADER_BYTES],
                                                          "little")
    if head[:4] != HEADER_MAGIC:
        raise HeaderError(f"header magic is {head[:4]!r}, expected {HEADER_MAGIC!r}")
    if xxhash.xxh3_64_intdigest(head) != check:
        raise HeaderError("header checksum does not match (a torn header)")
    version = int.from_bytes(head[4:6], "little")
    if version != VERSION:
        raise HeaderError(f"header format version is {version}, expected {VERSION}")
    n = int.from_bytes(head[24:28], "little")
    fields: dict[str, object] = json.loads(head[28:28 + n])
    return fields


def block_checksum(buffers: list[memoryview] | tuple[memoryview, ...]) -> int:
    """XXH3-128 of a block's bytes given as its segments, in region order."""
    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(b)
    return int(h.intdigest())


def encode_record(seq: int, checksum: int, block_hash: int, parent: int | None,
                  hash_bytes: int, identity: bytes) -> bytes:
    """One :data:`RECORD_BYTES` record (see the module docstring)."""
    head = (RECORD_MAGIC + VERSION.to_bytes(2, "little") + bytes((hash_bytes,
            0 if parent is None else 1)) + seq.to_bytes(8, "little")
            + checksum.to_bytes(16, "little") + block_hash.to_bytes(32, "little")
            + (parent or 0).to_bytes(32, "little") + identity + bytes(8))
    return head + xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")


@dataclass(frozen=True)
class Record:
    """A decoded, intact record of block ``block``."""

    block: int
    seq: int
    checksum: int
    hash: int
    parent: int | None


def decode_records(raw: bytes, identity: bytes, hash_bytes: int) -> tuple[list[Record], int]:
    """The intact records of ``raw`` (records back to back, block ``i`` at ``i *
    RECORD_BYTES``) written by a tier of ``identity`` with ``hash_bytes``-byte
    hashes, and how many others were not blank (torn, foreign or of another
    format: dropped as ``record``). Blank (all-zero) records were never written."""
    n = len(raw) // RECORD_BYTES
    arr: npt.NDArray[np.void] = np.frombuffer(raw, dtype=RECORD, count=n)
    used = np.flatnonzero(arr["magic"] != b"")
    mv = memoryview(raw)
    f = xxhash.xxh3_64_intdigest
    out: list[Record] = []
    bad = 0
    for i in used.tolist():
        r = arr[i]
        off = i * RECORD_BYTES
        if (r["magic"] != RECORD_MAGIC or int(r["version"]) != VERSION
                or int(r["hash_bytes"]) != hash_bytes
                or f(mv[off:off + RECORD_BYTES - 8]) != int(r["check"])
                or bytes(r["identity"]) != identity):
            bad += 1
            continue
        out.append(Record(
            block=i, seq=int(r["seq"]),
            checksum=int(r["sum_lo"]) | int(r["sum_hi"]) << 64,
            hash=int.from_bytes(bytes(r["hash"]), "little"),
            parent=int.from_bytes(bytes(r["parent"]), "little") if int(r["flags"]) & 1
            else None,
        ))
    return out, bad

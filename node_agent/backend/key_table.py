"""A hash table of 64-bit keys -> node ids in numpy arrays, probed for a whole prompt at once.

Buckets of :data:`SLOTS` slots (one 64-byte line of keys per bucket), at least
twice as many slots as the table may ever hold, so a bucket holds four keys on
average and a lookup is one gather of one row per key. A key that finds its home
bucket full goes to the next bucket and counts itself in the ``over`` count of
every bucket it passed; a lookup moves on to the next bucket only while that
count is non-zero, and a delete walks the same path back down. There are no
tombstones and nothing is ever rehashed.

Key 0 marks an empty slot, so callers must never store 0 (:func:`as_keys` maps
it to a fixed stand-in: one more 2^-64 collision, like any other).

Compared with a ``dict`` of Python ints, a lookup of 2048 keys is a handful of
numpy gathers (the CPU overlaps their cache misses) instead of 2048 interpreted
probes that each miss the cache two or three times, and a key costs 24 bytes
instead of about 100 (dict entry, key and value objects).

Not thread-safe; keys must be unique (insert only absent keys).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Keys = npt.NDArray[np.uint64]
Ids = npt.NDArray[np.int64]

#: Slots per bucket.
SLOTS = 8
_MASK64 = (1 << 64) - 1
#: What key 0 is stored as (0 marks an empty slot).
ZERO_STANDIN = 0x9E3779B97F4A7C15
# Multiplying a single set byte 2^(8c) by this puts c in the top byte.
_BYTE_INDEX = np.uint64(0x0001020304050607)


def as_keys(hashes: Sequence[int], wide: bool = False) -> Keys:
    """Table keys of block hashes: the low 64 bits, 0 replaced by :data:`ZERO_STANDIN`.

    ``wide`` hashes (over 64 bits) are masked in Python first; narrow ones go
    to numpy as they are.
    """
    keys = np.array([h & _MASK64 for h in hashes] if wide else hashes, dtype=np.uint64)
    keys[keys == 0] = ZERO_STANDIN
    return keys


def _row_bits(rows: npt.NDArray[np.bool_]) -> Keys:
    """Each row of an ``(m, 8)`` bool array as one uint64, column ``c`` in byte ``c``."""
    return rows.view("<u8").ravel()


def _first_set_byte(bits: Keys) -> npt.NDArray[np.intp]:
    """For non-zero :func:`_row_bits` values, the column of the row's first True."""
    lowest = bits & (~bits + np.uint64(1))
    return ((lowest * _BYTE_INDEX) >> np.uint64(56)).astype(np.intp)


class KeyTable:
    """At most ``capacity`` distinct non-zero uint64 keys, each mapped to an id >= 0."""

    def __init__(self, capacity: int) -> None:
        buckets = 1
        while buckets * SLOTS < 2 * max(1, capacity):
            buckets *= 2
        self.capacity = capacity
        self._bmask = buckets - 1
        self._keys: Keys = np.zeros((buckets, SLOTS), dtype=np.uint64)
        self._vals = np.full((buckets, SLOTS), -1, dtype=np.int32)
        self._over = np.zeros(buckets, dtype=np.int32)
        self._claim = np.zeros(buckets, dtype=np.int32)  # insert scratch: one key per bucket
        self._kflat, self._vflat = self._keys.reshape(-1), self._vals.reshape(-1)
        self._kv, self._vv, self._ov = self._kflat.data, self._vflat.data, self._over.data
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def ids(self) -> Ids:
        """Every stored id, in slot order."""
        v = self._vflat
        return v[v >= 0].astype(np.int64)

    def find(self, keys: Keys) -> Ids:
        """The flat slot of each key, -1 where absent."""
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        idx = np.arange(n)
        b = (keys & np.uint64(self._bmask)).astype(np.intp)
        for _ in range(self._bmask + 1):  # at most one pass over every bucket
            bits = _row_bits(self._keys.take(b, axis=0) == keys[:, None])
            hit = bits != 0
            if hit.any():
                out[idx[hit]] = b[hit] * SLOTS + _first_set_byte(bits[hit])
            more = ~hit & (self._over.take(b) > 0)
            if not more.any():
                break
            idx, keys, b = idx[more], keys[more], (b[more] + 1) & self._bmask
        return out

    def lookup(self, keys: Keys) -> Ids:
        """The id of each key, -1 where absent."""
        pos = self.find(keys)
        return np.where(pos >= 0, self._vflat.take(np.maximum(pos, 0)), -1).astype(np.int64)

    def lookup_slots(self, slots: Ids) -> Ids:
        """The id stored at each flat slot (-1 for an empty one)."""
        return self._vflat.take(slots).astype(np.int64)

    def get(self, key: int) -> int:
        """The id of one key, -1 when absent."""
        b = key & self._bmask
        kv, vv = self._kv, self._vv
        for _ in range(self._bmask + 1):
            base = b * SLOTS
            for s in range(base, base + SLOTS):
                if kv[s] == key:
                    return int(vv[s])
            if not self._ov[b]:
                return -1
            b = (b + 1) & self._bmask
        return -1

    def insert(self, keys: Keys, ids: Ids) -> None:
        """Store absent, distinct ``keys`` -> ``ids``."""
        n = len(keys)
        if self.count + n > self.capacity:
            raise OverflowError(
                f"key table holds {self.count} of {self.capacity} keys; {n} more do not fit"
            )
        idx = np.arange(n, dtype=np.int64)
        b = (keys & np.uint64(self._bmask)).astype(np.intp)
        while len(idx):
            self._claim[b] = idx  # several keys of one bucket: one of them wins this round
            win = np.flatnonzero(self._claim.take(b) == idx)
            wb = b[win]
            bits = _row_bits(self._vals.take(wb, axis=0) < 0)
            has = bits != 0
            done = win[has]
            placed = idx[done]
            slot = wb[has] * SLOTS + _first_set_byte(bits[has])
            self._kflat[slot] = keys[placed]
            self._vflat[slot] = ids[placed]
            moved = win[~has]  # home full: distinct buckets (one winner each), counted
            if len(moved):
                self._over[b[moved]] += 1
                b[moved] = (b[moved] + 1) & self._bmask
            keep = np.ones(len(idx), dtype=np.bool_)
            keep[done] = False
            idx, b = idx[keep], b[keep]
        self.count += n

    def delete_at(self, slots: Ids, keys: Keys) -> None:
        """Remove the keys stored at flat ``slots`` (as :meth:`find` gave them)."""
        if not len(slots):
            return
        self._kflat[slots] = 0
        self._vflat[slots] = -1
        self.count -= len(slots)
        home = (keys & np.uint64(self._bmask)).astype(np.intp)
        away = np.flatnonzero(slots // SLOTS != home)
        for j in away.tolist():  # rare: keys stored past a full home bucket
            b, end = int(home[j]), int(slots[j]) // SLOTS
            while b != end:
                self._ov[b] -= 1
                b = (b + 1) & self._bmask

    def delete(self, key: int) -> None:
        """Remove one present key (``KeyError`` when absent)."""
        b = key & self._bmask
        home = b
        kv = self._kv
        for _ in range(self._bmask + 1):
            base = b * SLOTS
            for s in range(base, base + SLOTS):
                if kv[s] == key:
                    kv[s] = 0
                    self._vv[s] = -1
                    self.count -= 1
                    while home != b:
                        self._ov[home] -= 1
                        home = (home + 1) & self._bmask
                    return
            if not self._ov[b]:
                break
            b = (b + 1) & self._bmask
        raise KeyError(f"key {key:#x} is not in the table")

"""Free block numbers of one tier: a FIFO in a fixed numpy ring buffer.

Blocks are taken from the front and returned to the back, so a freed block is
reused last (as a ``deque`` would do), but a run of ``k`` blocks is taken with
one slice instead of ``k`` pops, and the ring is one ``int64`` array rather than
a Python object per block.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

Blocks = npt.NDArray[np.int64]


class BlockRing:
    """At most ``capacity`` block numbers in FIFO order; starts full with ``0..capacity-1``.

    Overfilling (more blocks than ``capacity``) or taking from an empty ring
    raises ``IndexError``: either means a block was freed twice or lost, a bug of
    the caller.
    """

    def __init__(self, capacity: int) -> None:
        self._buf: Blocks = np.arange(capacity, dtype=np.int64)
        self._view = self._buf.data  # scalar reads return ints without numpy boxing
        self._cap = capacity
        self._head = 0
        self._size = capacity

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[int]:
        """Blocks from front to back."""
        return iter(self.peek(self._size).tolist())

    def peek(self, k: int) -> Blocks:
        """A copy of the first ``k`` blocks, in order, without taking them."""
        if not 0 <= k <= self._size:
            raise IndexError(f"cannot peek {k} blocks from a ring holding {self._size}")
        end = self._head + k
        if end <= self._cap:
            return self._buf[self._head:end].copy()
        return np.concatenate((self._buf[self._head:], self._buf[: end - self._cap]))

    def take(self, k: int) -> Blocks:
        """Remove and return the first ``k`` blocks, in order."""
        out = self.peek(k)
        if k:
            self._head = (self._head + k) % self._cap
            self._size -= k
        return out

    def popleft(self) -> int:
        """Remove and return the front block."""
        if not self._size:
            raise IndexError("no free block left in the ring")
        block = int(self._view[self._head])
        self._head = (self._head + 1) % self._cap
        self._size -= 1
        return block

    def append(self, block: int) -> None:
        """Return ``block`` to the back."""
        if self._size >= self._cap:
            raise IndexError(f"ring of {self._cap} blocks is full; block {block} freed twice?")
        self._view[(self._head + self._size) % self._cap] = block
        self._size += 1

    def extend(self, blocks: Blocks) -> None:
        """Return ``blocks`` to the back, in order."""
        k = len(blocks)
        if self._size + k > self._cap:
            raise IndexError(
                f"ring of {self._cap} blocks holds {self._size}; {k} more do not fit "
                "(a block freed twice?)"
            )
        if not k:
            return
        start = (self._head + self._size) % self._cap
        first = min(k, self._cap - start)
        self._buf[start:start + first] = blocks[:first]
        self._buf[: k - first] = blocks[first:]
        self._size += k

    def appendleft(self, block: int) -> None:
        """Put ``block`` back at the front (an allocation rolled back)."""
        if self._size >= self._cap:
            raise IndexError(f"ring of {self._cap} blocks is full; block {block} freed twice?")
        self._head = (self._head - 1) % self._cap
        self._view[self._head] = block
        self._size += 1

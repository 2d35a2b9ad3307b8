"""The block index of a stage leader: block hash -> tier location, LRU with leaf-first eviction.

Each cached block is a *node* whose parent is the block before it in its prefix
chain, so the index is a radix tree of blocks (as FlexKV's). Rules:

* **Visibility.** A stored block is *pending* (invisible to lookups) until its
  put finishes (or, with deferred visibility, until the leader publishes it).
* **Locking.** A node with ``locks > 0`` (matched by a live task, or pending) is
  never evicted, moved or overwritten.
* **Leaf-first.** A block is *dropped* (leaves the index) only when no cached
  block descends from it, so no unreachable block lingers. A CPU block is
  *spilled* to SSD when no child of it is on the CPU (spilling keeps it
  reachable, so the rule is only about keeping prefix heads on the fast tier).
* **LRU.** Among the candidates, the least recently touched goes first. A
  match touches every block of the matched prefix.
* **Watermarks.** When a tier's use rises above ``high`` it is evicted down to
  ``low`` (fractions of its blocks); an allocation in a full tier evicts one.

CPU eviction spills to SSD when an SSD block is free or can be freed by dropping
an SSD leaf; otherwise it drops a CPU leaf. A spill's copy runs through the
``mover`` callback *before* the index changes; if it raises ``OSError`` (a full
or failing disk) the block stays on the CPU and a CPU leaf is dropped instead,
so the index never points at bytes that were not written. Every decision is
returned as a :class:`~.replication.TierMove` (already executed locally) for the
caller to record and, on a PP leader, to fan out before any later plan.

Representation: nodes are integer ids into parallel lists of ints (and
``bytearray`` flags), and the hash map holds ints only. No per-block object is
tracked by the cyclic garbage collector (ints are not; the few lists are walked
quickly), and a node costs a few list slots instead of an object. Lists rather
than ``array.array`` because reading a list slot does not box a new int.
Node ids are recycled; each reuse bumps the id's generation. :attr:`epoch`
changes when :meth:`clear` forgets everything, so holders of ids from before a
flush can tell.

Candidates live in lazy heaps of ``(tick, seq, id, generation)``; an entry whose
node changed or was recycled since is skipped when popped, and heaps are rebuilt
when stale entries outnumber live nodes.

Not thread-safe: the backend calls it under its own lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from node_agent.backend.replication import BlockLocation, Tier, TierMove

log = logging.getLogger(__name__)

#: A node id: an index into the index's per-node arrays.
NodeId = int

_CPU, _SSD = 0, 1
_TIER_OF = (Tier.CPU, Tier.SSD)
_Entry = tuple[int, int, int, int]


def _zeros(n: int) -> list[int]:
    return [0] * n


class BlockIndex:
    """Hash -> node for a CPU tier of ``cpu_blocks`` and an SSD tier of ``ssd_blocks``."""

    def __init__(
        self,
        cpu_blocks: int,
        ssd_blocks: int,
        high: float,
        low: float,
        mover: Callable[[TierMove], None] | None = None,
    ) -> None:
        self.capacity = {Tier.CPU: cpu_blocks, Tier.SSD: ssd_blocks}
        self.high = high
        self.low = low
        self._mover: Callable[[TierMove], None] = mover or (lambda move: None)
        self.spill_failures = 0
        self.evictions = {Tier.CPU: 0, Tier.SSD: 0}
        self.epoch = 0
        # One BlockLocation per physical block, made on first use and reused:
        # constructing a frozen dataclass costs microseconds on the match path.
        self._locs: dict[Tier, list[BlockLocation | None]] = {
            Tier.CPU: [None] * cpu_blocks, Tier.SSD: [None] * ssd_blocks,
        }
        self._seq = itertools.count()
        self._gen = _zeros(cpu_blocks + ssd_blocks)  # survives clear(): ids stay unique
        self._reset_state()

    def _reset_state(self) -> None:
        n = self.capacity[Tier.CPU] + self.capacity[Tier.SSD]
        self.nodes: dict[int, NodeId] = {}
        self.free: dict[Tier, deque[int]] = {
            Tier.CPU: deque(range(self.capacity[Tier.CPU])),
            Tier.SSD: deque(range(self.capacity[Tier.SSD])),
        }
        self._free_ids = list(range(n - 1, -1, -1))
        self._hash: list[int] = [0] * n
        self._parent = [-1] * n
        self._children = _zeros(n)
        self._cpu_children = _zeros(n)
        self._tier = bytearray(n)
        self._block = _zeros(n)
        self._locks = _zeros(n)
        self._visible = bytearray(n)
        self._tick = _zeros(n)
        self._clock = 0
        self._spill: list[_Entry] = []
        self._drop_cpu: list[_Entry] = []
        self._drop_ssd: list[_Entry] = []
        self._entries = 0

    # -- queries --------------------------------------------------------------

    def used(self, tier: Tier) -> int:
        """Blocks of ``tier`` holding a node (visible or pending)."""
        return self.capacity[tier] - len(self.free[tier])

    def match(self, hashes: Sequence[int]) -> list[NodeId]:
        """The visible nodes of the longest cached prefix of ``hashes``.

        A node is accepted only if its parent is the previous node, so a hash
        collision with a block of another chain ends the match instead of
        splicing two chains.
        """
        out: list[NodeId] = []
        prev = -1
        get, visible, parent = self.nodes.get, self._visible, self._parent
        for h in hashes:
            i = get(h)
            if i is None or not visible[i] or parent[i] != prev:
                break
            out.append(i)
            prev = i
        return out

    def location(self, node: NodeId) -> BlockLocation:
        """Where ``node``'s block lives."""
        return self._location(_TIER_OF[self._tier[node]], self._block[node])

    def locations(self, nodes: Iterable[NodeId]) -> tuple[BlockLocation, ...]:
        """Where each of ``nodes`` lives, in order."""
        tier, block, loc = self._tier, self._block, self._location
        return tuple([loc(_TIER_OF[tier[i]], block[i]) for i in nodes])

    def locked(self) -> int:
        """Nodes holding at least one pin."""
        locks = self._locks
        return sum(1 for i in self.nodes.values() if locks[i])

    # -- state changes ----------------------------------------------------------

    def touch(self, nodes: Iterable[NodeId]) -> None:
        """Mark ``nodes`` most recently used."""
        self._clock += 1
        t = self._clock
        tick, children, cpu_children, offer = self._tick, self._children, self._cpu_children, \
            self._offer
        for i in nodes:
            tick[i] = t
            if not children[i] or not cpu_children[i]:  # else it cannot be a candidate
                offer(i)

    def lock(self, nodes: Iterable[NodeId]) -> None:
        """Pin ``nodes`` (a task uses them)."""
        locks = self._locks
        for i in nodes:
            locks[i] += 1

    def unlock(self, nodes: Iterable[NodeId]) -> None:
        """Release one pin of each of ``nodes``."""
        locks, children, cpu_children, offer = self._locks, self._children, \
            self._cpu_children, self._offer
        for i in nodes:
            locks[i] -= 1
            if not locks[i] and (not children[i] or not cpu_children[i]):
                offer(i)

    def add_pending(
        self, parent: NodeId | None, hashes: Sequence[int], moves: list[TierMove]
    ) -> list[NodeId]:
        """Reserve CPU blocks for ``hashes`` (a chain continuing ``parent``).

        Returns the pending, locked nodes created: fewer than ``hashes`` (a
        prefix of them) when the CPU tier has no more evictable blocks. Eviction
        decisions are appended to ``moves``.
        """
        created: list[NodeId] = []
        if parent is not None:
            self._locks[parent] += 1  # the parent must survive the evictions below
        try:
            prev = -1 if parent is None else parent
            self._clock += 1
            t, free, nodes, ids = self._clock, self.free[Tier.CPU], self.nodes, self._free_ids
            hash_, par, kids, cpu_kids = self._hash, self._parent, self._children, \
                self._cpu_children
            tier, block_of, locks, visible, tick, gen = self._tier, self._block, self._locks, \
                self._visible, self._tick, self._gen
            for h in hashes:  # the hot loop of a long new prompt: keep it inlined
                block = free.popleft() if free else self._allocate(Tier.CPU, moves)
                if block is None:
                    break
                i = ids.pop()  # never empty: a node per block, and a block was free
                gen[i] += 1
                hash_[i], par[i], kids[i], cpu_kids[i] = h, prev, 0, 0
                tier[i], block_of[i], locks[i], visible[i], tick[i] = _CPU, block, 1, 0, t
                nodes[h] = i
                if prev >= 0:
                    kids[prev] += 1
                    cpu_kids[prev] += 1
                created.append(i)
                prev = i
        finally:
            if parent is not None:
                self.unlock([parent])
        return created

    def publish(self, nodes: Iterable[NodeId]) -> None:
        """Make pending ``nodes`` visible and release their pending pin."""
        self._clock += 1
        t = self._clock
        for i in nodes:
            self._visible[i] = 1
            self._tick[i] = t
            self._locks[i] -= 1
            self._offer(i)

    def remove_pending(self, nodes: Sequence[NodeId]) -> None:
        """Forget pending ``nodes`` (a put failed or was discarded): deepest first."""
        for i in reversed(nodes):
            if self.nodes.get(self._hash[i]) == i:
                self._locks[i] = 0
                self._remove(i)

    def enforce_watermarks(self, moves: list[TierMove]) -> None:
        """Evict tiers above the high watermark down to the low watermark."""
        for tier in (Tier.CPU, Tier.SSD):
            cap = self.capacity[tier]
            if cap and self.used(tier) > self.high * cap:
                target = int(self.low * cap)
                while self.used(tier) > target and self._evict_one(tier, moves):
                    pass

    def clear(self) -> None:
        """Forget every block (a flush); ids handed out before are void (``epoch`` moves)."""
        self.epoch += 1
        for i in self.nodes.values():
            self._gen[i] += 1
        self._reset_state()

    def check_consistency(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (for tests and
        debugging; O(nodes)): every node's parent is cached, child counts are exact,
        no block is held twice or lost, no pin count is negative."""
        alive = dict(self.nodes)
        kids: dict[int, int] = {}
        cpu_kids: dict[int, int] = {}
        held: dict[int, set[int]] = {_CPU: set(), _SSD: set()}
        for h, i in alive.items():
            if self._hash[i] != h:
                raise AssertionError(
                    f"node {i} is filed under {h:#x} but hashes {self._hash[i]:#x}"
                )
            p = self._parent[i]
            if p >= 0:
                if alive.get(self._hash[p]) != p:
                    raise AssertionError(f"node {i} has parent {p}, which is not cached")
                kids[p] = kids.get(p, 0) + 1
                if self._tier[i] == _CPU:
                    cpu_kids[p] = cpu_kids.get(p, 0) + 1
            if self._block[i] in held[self._tier[i]]:
                raise AssertionError(f"block {self._block[i]} of tier {self._tier[i]} held twice")
            held[self._tier[i]].add(self._block[i])
            if self._locks[i] < 0:
                raise AssertionError(f"node {i} has {self._locks[i]} pins")
        for i in alive.values():
            if self._children[i] != kids.get(i, 0) or self._cpu_children[i] != cpu_kids.get(i, 0):
                raise AssertionError(
                    f"node {i} counts {self._children[i]}/{self._cpu_children[i]} children, "
                    f"has {kids.get(i, 0)}/{cpu_kids.get(i, 0)}"
                )
        for code, tier in enumerate(_TIER_OF):
            free = list(self.free[tier])
            cap = self.capacity[tier]
            if len(set(free)) != len(free) or set(free) & held[code]:
                raise AssertionError(f"{tier.value} free list holds a duplicate or a used block")
            if len(free) + len(held[code]) != cap or any(not 0 <= b < cap for b in free):
                raise AssertionError(
                    f"{tier.value}: {len(held[code])} held + {len(free)} free != {cap} blocks"
                )

    # -- eviction -----------------------------------------------------------

    def _location(self, tier: Tier, index: int) -> BlockLocation:
        locs = self._locs[tier]
        loc = locs[index]
        if loc is None:
            loc = locs[index] = BlockLocation(tier, index)
        return loc

    def _allocate(self, tier: Tier, moves: list[TierMove]) -> int | None:
        free = self.free[tier]
        if not free and not self._evict_one(tier, moves):
            return None
        return free.popleft()

    def _evict_one(self, tier: Tier, moves: list[TierMove]) -> bool:
        """Free one block of ``tier``; False when every block there is pinned or interior."""
        if tier is Tier.CPU and self.capacity[Tier.SSD]:
            i = self._pop(self._spill, self._spillable)
            if i is not None:
                dst = self._allocate(Tier.SSD, moves)
                if dst is not None:
                    src = self.location(i)
                    move = TierMove(src, self._location(Tier.SSD, dst))
                    try:
                        self._mover(move)  # copy first: the index changes only once it holds
                    except OSError as e:
                        self.free[Tier.SSD].appendleft(dst)
                        self.spill_failures += 1
                        log.error("Spill to SSD failed; dropping a CPU block instead",
                                  extra={"src": src.index, "dst": dst, "error": str(e)})
                    else:
                        self._tier[i], self._block[i] = _SSD, dst
                        p = self._parent[i]
                        if p >= 0:
                            self._cpu_children[p] -= 1
                            self._offer(p)
                        self.free[Tier.CPU].append(src.index)
                        self.evictions[Tier.CPU] += 1
                        moves.append(move)
                        self._offer(i)
                        return True
                self._offer(i)  # still a candidate; SSD was full of pinned blocks
        heap = self._drop_cpu if tier is Tier.CPU else self._drop_ssd
        code = _CPU if tier is Tier.CPU else _SSD
        i = self._pop(heap, lambda n: self._droppable(n, code))
        if i is None:
            return False
        moves.append(TierMove(self.location(i), None))
        self.evictions[tier] += 1
        self._remove(i)
        return True

    def _remove(self, i: NodeId) -> None:
        del self.nodes[self._hash[i]]
        code, block = self._tier[i], self._block[i]
        self.free[_TIER_OF[code]].append(block)
        self._visible[i] = 0
        self._locks[i] = 0
        self._gen[i] += 1  # voids heap entries of this id
        self._free_ids.append(i)
        p = self._parent[i]
        if p >= 0:
            self._children[p] -= 1
            if code == _CPU:
                self._cpu_children[p] -= 1
            self._offer(p)

    def _spillable(self, i: NodeId) -> bool:
        return bool(self._visible[i] and not self._locks[i] and self._tier[i] == _CPU
                    and not self._cpu_children[i])

    def _droppable(self, i: NodeId, code: int) -> bool:
        return bool(self._visible[i] and not self._locks[i] and not self._children[i]
                    and self._tier[i] == code)

    def _offer(self, i: NodeId) -> None:
        """Queue node ``i`` as an eviction candidate if it is one now (hot path: lean)."""
        if self._locks[i] or not self._visible[i]:
            return
        on_cpu = self._tier[i] == _CPU
        spill = on_cpu and not self._cpu_children[i]
        drop = not self._children[i]
        if not (spill or drop):
            return
        entry = (self._tick[i], next(self._seq), i, self._gen[i])
        if spill:
            heapq.heappush(self._spill, entry)
            self._entries += 1
        if drop:
            heapq.heappush(self._drop_cpu if on_cpu else self._drop_ssd, entry)
            self._entries += 1
        if self._entries > 4 * len(self.nodes) + 4096:
            self._rebuild()

    def _pop(self, heap: list[_Entry], check: Callable[[NodeId], bool]) -> NodeId | None:
        tick, gen = self._tick, self._gen
        while heap:
            t, _, i, g = heapq.heappop(heap)
            if gen[i] == g and tick[i] == t and check(i):
                return i
        return None

    def _rebuild(self) -> None:
        """Drop stale heap entries: re-offer every node from scratch."""
        self._spill, self._drop_cpu, self._drop_ssd = [], [], []
        for i in self.nodes.values():
            if not self._visible[i] or self._locks[i]:
                continue
            entry = (self._tick[i], next(self._seq), i, self._gen[i])
            on_cpu = self._tier[i] == _CPU
            if on_cpu and not self._cpu_children[i]:
                self._spill.append(entry)
            if not self._children[i]:
                (self._drop_cpu if on_cpu else self._drop_ssd).append(entry)
        for h in (self._spill, self._drop_cpu, self._drop_ssd):
            heapq.heapify(h)
        self._entries = len(self._spill) + len(self._drop_cpu) + len(self._drop_ssd)

"""The block index of a stage leader: block hash -> tier location, LRU with leaf-first eviction.

Each cached block is a :class:`Node` whose parent is the block before it in its
prefix chain, so the index is a radix tree of blocks (as FlexKV's). Rules:

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

Candidates live in lazy heaps: entries carry the node's touch tick; an entry
whose node changed since is skipped when popped, and heaps are rebuilt when
stale entries outnumber live nodes.

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


class Node:
    """One cached block."""

    __slots__ = ("children", "cpu_children", "hash", "loc", "locks", "parent", "tick", "visible")

    def __init__(self, h: int, parent: Node | None, loc: BlockLocation, tick: int) -> None:
        self.hash = h
        self.parent = parent
        self.loc: BlockLocation | None = loc
        self.children = 0
        self.cpu_children = 0
        self.locks = 1
        self.visible = False
        self.tick = tick


_Entry = tuple[int, int, Node]


class BlockIndex:
    """Hash -> :class:`Node` for a CPU tier of ``cpu_blocks`` and an SSD tier of ``ssd_blocks``."""

    def __init__(
        self,
        cpu_blocks: int,
        ssd_blocks: int,
        high: float,
        low: float,
        mover: Callable[[TierMove], None] | None = None,
    ) -> None:
        self.capacity = {Tier.CPU: cpu_blocks, Tier.SSD: ssd_blocks}
        self._mover: Callable[[TierMove], None] = mover or (lambda move: None)
        self.spill_failures = 0
        self.high = high
        self.low = low
        self.nodes: dict[int, Node] = {}
        self.free: dict[Tier, deque[int]] = {
            Tier.CPU: deque(range(cpu_blocks)),
            Tier.SSD: deque(range(ssd_blocks)),
        }
        self.evictions = {Tier.CPU: 0, Tier.SSD: 0}
        # One BlockLocation per physical block, made on first use and reused:
        # constructing a frozen dataclass costs microseconds on the match path.
        self._locs: dict[Tier, list[BlockLocation | None]] = {
            Tier.CPU: [None] * cpu_blocks, Tier.SSD: [None] * ssd_blocks,
        }
        self._clock = 0
        self._seq = itertools.count()
        self._spill: list[_Entry] = []
        self._drop_cpu: list[_Entry] = []
        self._drop_ssd: list[_Entry] = []
        self._entries = 0

    # -- queries --------------------------------------------------------------

    def used(self, tier: Tier) -> int:
        """Blocks of ``tier`` holding a node (visible or pending)."""
        return self.capacity[tier] - len(self.free[tier])

    def match(self, hashes: Sequence[int]) -> list[Node]:
        """The visible nodes of the longest cached prefix of ``hashes``.

        A node is accepted only if its parent is the previous node, so a hash
        collision with a block of another chain ends the match instead of
        splicing two chains.
        """
        out: list[Node] = []
        prev: Node | None = None
        get = self.nodes.get
        for h in hashes:
            n = get(h)
            if n is None or not n.visible or n.parent is not prev:
                break
            out.append(n)
            prev = n
        return out

    # -- state changes ----------------------------------------------------------

    def touch(self, nodes: Iterable[Node]) -> None:
        """Mark ``nodes`` most recently used."""
        self._clock += 1
        t = self._clock
        offer = self._offer
        for n in nodes:
            n.tick = t
            if not n.children or not n.cpu_children:  # else it cannot be a candidate
                offer(n)

    def lock(self, nodes: Iterable[Node]) -> None:
        """Pin ``nodes`` (a task uses them)."""
        for n in nodes:
            n.locks += 1

    def unlock(self, nodes: Iterable[Node]) -> None:
        """Release one pin of each of ``nodes``."""
        offer = self._offer
        for n in nodes:
            n.locks -= 1
            if not n.locks and (not n.children or not n.cpu_children):
                offer(n)

    def add_pending(
        self, parent: Node | None, hashes: Sequence[int], moves: list[TierMove]
    ) -> list[Node]:
        """Reserve CPU blocks for ``hashes`` (a chain continuing ``parent``).

        Returns the pending, locked nodes created: fewer than ``hashes`` (a
        prefix of them) when the CPU tier has no more evictable blocks. Eviction
        decisions are appended to ``moves``.
        """
        created: list[Node] = []
        if parent is not None:
            parent.locks += 1  # the parent must survive the evictions below
        try:
            prev = parent
            self._clock += 1
            tick, free, locs, nodes = self._clock, self.free[Tier.CPU], self._locs[Tier.CPU], \
                self.nodes
            for h in hashes:  # the hot loop of a long new prompt: keep it inlined
                block = free.popleft() if free else self._allocate(Tier.CPU, moves)
                if block is None:
                    break
                node = Node(h, prev, locs[block] or self._location(Tier.CPU, block), tick)
                nodes[h] = node
                if prev is not None:
                    prev.children += 1
                    prev.cpu_children += 1
                created.append(node)
                prev = node
        finally:
            if parent is not None:
                self.unlock([parent])
        return created

    def publish(self, nodes: Iterable[Node]) -> None:
        """Make pending ``nodes`` visible and release their pending pin."""
        self._clock += 1
        for n in nodes:
            n.visible = True
            n.tick = self._clock
            n.locks -= 1
            self._offer(n)

    def remove_pending(self, nodes: Sequence[Node]) -> None:
        """Forget pending ``nodes`` (a put failed or was discarded): deepest first."""
        for n in reversed(nodes):
            if n.loc is not None and self.nodes.get(n.hash) is n:
                n.locks = 0
                self._remove(n)

    def enforce_watermarks(self, moves: list[TierMove]) -> None:
        """Evict tiers above the high watermark down to the low watermark."""
        for tier in (Tier.CPU, Tier.SSD):
            cap = self.capacity[tier]
            if cap and self.used(tier) > self.high * cap:
                target = int(self.low * cap)
                while self.used(tier) > target and self._evict_one(tier, moves):
                    pass

    def clear(self) -> None:
        """Forget every block (a flush)."""
        for n in self.nodes.values():
            n.loc = None
        self.nodes.clear()
        for tier, cap in self.capacity.items():
            self.free[tier] = deque(range(cap))
        self._spill, self._drop_cpu, self._drop_ssd = [], [], []
        self._entries = 0

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
            node = self._pop(self._spill, self._spillable)
            if node is not None:
                dst = self._allocate(Tier.SSD, moves)
                if dst is not None:
                    assert node.loc is not None
                    src = node.loc
                    move = TierMove(src, self._location(Tier.SSD, dst))
                    try:
                        self._mover(move)  # copy first: the index changes only once it holds
                    except OSError as e:
                        self.free[Tier.SSD].appendleft(dst)
                        self.spill_failures += 1
                        log.error("Spill to SSD failed; dropping a CPU block instead",
                                  extra={"src": src.index, "dst": dst, "error": str(e)})
                    else:
                        node.loc = move.dst
                        if node.parent is not None:
                            node.parent.cpu_children -= 1
                            self._offer(node.parent)
                        self.free[Tier.CPU].append(src.index)
                        self.evictions[Tier.CPU] += 1
                        moves.append(move)
                        self._offer(node)
                        return True
                self._offer(node)  # still a candidate; SSD was full of pinned blocks
        heap = self._drop_cpu if tier is Tier.CPU else self._drop_ssd
        node = self._pop(heap, lambda n: self._droppable(n, tier))
        if node is None:
            return False
        assert node.loc is not None
        moves.append(TierMove(node.loc, None))
        self.evictions[tier] += 1
        self._remove(node)
        return True

    def _remove(self, node: Node) -> None:
        loc = node.loc
        assert loc is not None
        del self.nodes[node.hash]
        node.loc = None
        self.free[loc.tier].append(loc.index)
        p = node.parent
        if p is not None:
            p.children -= 1
            if loc.tier is Tier.CPU:
                p.cpu_children -= 1
            self._offer(p)

    @staticmethod
    def _spillable(n: Node) -> bool:
        return (n.loc is not None and n.visible and n.locks == 0 and n.loc.tier is Tier.CPU
                and n.cpu_children == 0)

    @staticmethod
    def _droppable(n: Node, tier: Tier) -> bool:
        return (n.loc is not None and n.visible and n.locks == 0 and n.children == 0
                and n.loc.tier is tier)

    def _offer(self, n: Node) -> None:
        """Queue ``n`` as an eviction candidate if it is one now (hot path: keep it lean)."""
        loc = n.loc
        if n.locks or not n.visible or loc is None:
            return
        on_cpu = loc.tier is Tier.CPU
        spill = on_cpu and n.cpu_children == 0
        drop = n.children == 0
        if not (spill or drop):
            return
        entry = (n.tick, next(self._seq), n)
        if spill:
            heapq.heappush(self._spill, entry)
            self._entries += 1
        if drop:
            heapq.heappush(self._drop_cpu if on_cpu else self._drop_ssd, entry)
            self._entries += 1
        if self._entries > 4 * len(self.nodes) + 4096:
            self._rebuild()

    @staticmethod
    def _pop(heap: list[_Entry], check: Callable[[Node], bool]) -> Node | None:
        while heap:
            tick, _, n = heapq.heappop(heap)
            if n.tick == tick and check(n):
                return n
        return None

    def _rebuild(self) -> None:
        """Drop stale heap entries: re-offer every node from scratch."""
        self._spill, self._drop_cpu, self._drop_ssd = [], [], []
        self._entries = 0
        for n in self.nodes.values():
            loc = n.loc
            if loc is None or not n.visible or n.locks:
                continue
            entry = (n.tick, next(self._seq), n)
            if loc.tier is Tier.CPU and n.cpu_children == 0:
                self._spill.append(entry)
            if n.children == 0:
                (self._drop_cpu if loc.tier is Tier.CPU else self._drop_ssd).append(entry)
        for h in (self._spill, self._drop_cpu, self._drop_ssd):
            heapq.heapify(h)
        self._entries = len(self._spill) + len(self._drop_cpu) + len(self._drop_ssd)

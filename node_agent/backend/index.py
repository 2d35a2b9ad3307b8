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

Representation (struct of arrays): a node is an integer id into numpy arrays
(hash key, parent, child counts, tier, block, pins, visibility, LRU tick,
generation), one slot per tier block, preallocated. Hashes map to ids in a
:class:`~.key_table.KeyTable` (numpy buckets of 64-bit keys), so no per-block
Python object exists but the cached :class:`BlockLocation` of each tier block.
Hashes wider than 64 bits (``hash_bits`` > 64) are filed under their low 64
bits and checked in full against a per-node list on every match, so a wide
algorithm keeps its collision resistance; two wide hashes sharing their low 64
bits cannot both be cached (the second is refused like a collision). The
per-prompt operations (match, touch, lock,
unlock, publish, reserving a run of new blocks, removing a pending run) are
vectorised over the whole prompt; the per-block eviction path reads and writes
the same arrays through ``memoryview``s, which return plain ints. Node ids are
recycled; each reuse bumps the id's generation. :attr:`epoch` changes when
:meth:`clear` forgets everything, so holders of ids from before a flush can tell.

Candidates live in lazy heaps of ``(tick, seq, id, generation)``; an entry whose
node changed or was recycled since is skipped when popped, and heaps are rebuilt
when stale entries outnumber live nodes.

Not thread-safe: the backend calls it under its own lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from node_agent.backend.block_ring import BlockRing
from node_agent.backend.key_table import ZERO_STANDIN, Keys, KeyTable, as_keys
from node_agent.vocab.placement import BlockLocation, Tier, TierMove, block_locations

log = logging.getLogger(__name__)

#: A node id: an index into the index's per-node arrays.
NodeId = int
#: Node ids of a prefix chain, in chain order (root side first).
NodeIds = npt.NDArray[np.int64]

_CPU, _SSD = 0, 1
_TIER_OF = (Tier.CPU, Tier.SSD)
_Entry = tuple[int, int, int, int]
#: No nodes (read-only).
NO_NODES: NodeIds = np.empty(0, dtype=np.int64)
NO_NODES.flags.writeable = False


def as_node_ids(nodes: NodeIds | Iterable[NodeId]) -> NodeIds:
    """``nodes`` as a 1-D int64 array (no copy when it already is one)."""
    if isinstance(nodes, np.ndarray):
        return nodes.astype(np.int64, copy=False)
    return np.fromiter(nodes, dtype=np.int64)


class BlockIndex:
    """Hash -> node for a CPU tier of ``cpu_blocks`` and an SSD tier of ``ssd_blocks``."""

    def __init__(
        self,
        cpu_blocks: int,
        ssd_blocks: int,
        high: float,
        low: float,
        mover: Callable[[TierMove], None] | None = None,
        hash_bits: int = 64,
    ) -> None:
        self.capacity = {Tier.CPU: cpu_blocks, Tier.SSD: ssd_blocks}
        self.high = high
        self.low = low
        self._mover: Callable[[TierMove], None] = mover or (lambda move: None)
        self.spill_failures = 0
        #: Called with ``(hash, cpu block)`` when a visible block leaves the CPU tier
        #: (spilled or dropped), before its CPU block can be reused (the remote
        #: tier's ``writePolicy: evict``).
        self.on_cpu_evict: Callable[[int, int], None] | None = None
        #: Called with ``(hash, parent hash or None, ssd block)`` once a spill's copy
        #: succeeded (a persistent SSD tier records the block's identity).
        self.on_spill: Callable[[int, int | None, int], None] | None = None
        #: Called with ``(hash, from tier, to tier or None)`` when a visible block is
        #: spilled or dropped (KV events for routers).
        self.on_move: Callable[[int, Tier, Tier | None], None] | None = None
        self.evictions = {Tier.CPU: 0, Tier.SSD: 0}
        self.epoch = 0
        n = cpu_blocks + ssd_blocks
        self._n = n
        self._wide = hash_bits > 64
        # One BlockLocation per physical block (CPU blocks, then SSD blocks), made on
        # first use and reused: building a frozen dataclass costs about a microsecond,
        # too much per block of a 2048-block plan. ``_made`` says which exist.
        self._locs: list[BlockLocation | None] = [None] * n
        self._made = np.zeros(n, dtype=np.bool_)
        self._seq = itertools.count()
        self._gen = np.zeros(n, dtype=np.int64)  # survives clear(): ids stay unique
        self._gen_v = self._gen.data
        self._reset_state()

    def _reset_state(self) -> None:
        n = self._n
        self._table = KeyTable(n)
        self.free: dict[Tier, BlockRing] = {
            Tier.CPU: BlockRing(self.capacity[Tier.CPU]),
            Tier.SSD: BlockRing(self.capacity[Tier.SSD]),
        }
        # A stack of unused ids; the top is at the end, id 0 on top.
        self._free_ids: NodeIds = np.arange(n - 1, -1, -1, dtype=np.int64)
        self._free_ids_v = self._free_ids.data
        self._nfree_ids = n
        self._key: Keys = np.zeros(n, dtype=np.uint64)
        self._key_v = self._key.data
        self._hash: list[int] = [0] * n if self._wide else []  # full wide hashes
        self._parent = np.full(n, -1, dtype=np.int32)
        self._children = np.zeros(n, dtype=np.int32)
        self._cpu_children = np.zeros(n, dtype=np.int32)
        self._tier = np.zeros(n, dtype=np.uint8)
        self._block = np.zeros(n, dtype=np.int32)
        self._locks = np.zeros(n, dtype=np.int32)
        self._visible = np.zeros(n, dtype=np.uint8)
        self._tick = np.zeros(n, dtype=np.int64)
        # Scalar access for the per-block paths (eviction, removal, heap checks).
        self._parent_v = self._parent.data
        self._children_v = self._children.data
        self._cpu_children_v = self._cpu_children.data
        self._tier_v = self._tier.data
        self._block_v = self._block.data
        self._locks_v = self._locks.data
        self._visible_v = self._visible.data
        self._tick_v = self._tick.data
        self._clock = 0
        self._spill: list[_Entry] = []
        self._drop_cpu: list[_Entry] = []
        self._drop_ssd: list[_Entry] = []
        self._entries = 0

    # -- queries --------------------------------------------------------------

    def used(self, tier: Tier) -> int:
        """Blocks of ``tier`` holding a node (visible or pending)."""
        return self.capacity[tier] - len(self.free[tier])

    def __len__(self) -> int:
        """Nodes in the index (visible or pending)."""
        return self._table.count

    def keys(self, hashes: Sequence[int]) -> Keys:
        """The table keys of ``hashes``; pass them to :meth:`match` and
        :meth:`add_pending` with the same hashes to convert only once."""
        return as_keys(hashes, self._wide)

    def contains(self, h: int) -> bool:
        """Whether a node (visible or pending) is filed under hash ``h``."""
        return self._lookup1(h) >= 0

    def match(self, hashes: Sequence[int], keys: Keys | None = None) -> NodeIds:
        """The visible nodes of the longest cached prefix of ``hashes``.

        A node is accepted only if its parent is the previous node, so a hash
        collision with a block of another chain ends the match instead of
        splicing two chains. Every hash is looked up and checked at once; the
        answer is the run before the first failure, so it does not rely on
        cached prefixes being contiguous.
        """
        n = len(hashes)
        if not n or self._lookup1(hashes[0]) < 0:
            return NO_NODES
        ids = self._lookup(hashes, self.keys(hashes) if keys is None else keys)
        safe = np.maximum(ids, 0)
        ok = (ids >= 0) & (self._visible.take(safe) != 0)
        parent = self._parent.take(safe)
        ok[0] &= parent[0] == -1
        ok[1:] &= parent[1:] == ids[:-1]
        k = n if ok.all() else int(ok.argmin())
        return ids[:k]

    def location(self, node: NodeId) -> BlockLocation:
        """Where ``node``'s block lives."""
        return self._location(self._tier_v[node] * self.capacity[Tier.CPU] + self._block_v[node])

    def locations(self, nodes: NodeIds | Iterable[NodeId]) -> tuple[BlockLocation, ...]:
        """Where each of ``nodes`` lives, in order."""
        ids = as_node_ids(nodes)
        if not len(ids):
            return ()
        flat = self._block.take(ids).astype(np.int64)
        tiers = self._tier.take(ids)
        if tiers.any():
            flat += tiers.astype(np.int64) * self.capacity[Tier.CPU]
        made = self._made.take(flat)
        if not made.all():
            self._make_locations(flat[~made])
        keys = flat.tolist()
        if len(keys) == 1:
            loc = self._locs[keys[0]]
            assert loc is not None
            return (loc,)
        return itemgetter(*keys)(self._locs)

    def ssd_blocks(self, nodes: NodeIds) -> int:
        """How many of ``nodes`` live on the SSD tier."""
        return int(np.count_nonzero(self._tier.take(as_node_ids(nodes))))

    def locked(self) -> int:
        """Nodes holding at least one pin."""
        return int(np.count_nonzero(self._locks.take(self._alive())))

    # -- state changes ----------------------------------------------------------

    def touch(self, nodes: NodeIds | Iterable[NodeId]) -> None:
        """Mark ``nodes`` most recently used."""
        ids = as_node_ids(nodes)
        self._clock += 1
        self._tick[ids] = self._clock
        self._offer_all(ids)

    def lock_counts(self, nodes: NodeIds | Iterable[NodeId]) -> NodeIds:
        """The pins each of ``nodes`` holds."""
        return self._locks.take(as_node_ids(nodes)).astype(np.int64)

    def lock(self, nodes: NodeIds | Iterable[NodeId]) -> None:
        """Pin ``nodes`` (a task uses them; distinct ids, as a chain's are)."""
        ids = as_node_ids(nodes)
        self._locks[ids] += 1

    def unlock(self, nodes: NodeIds | Iterable[NodeId]) -> None:
        """Release one pin of each of ``nodes`` (distinct ids)."""
        ids = as_node_ids(nodes)
        self._locks[ids] -= 1
        self._offer_all(ids)

    def add_pending(
        self, parent: NodeId | None, hashes: Sequence[int], moves: list[TierMove],
        keys: Keys | None = None,
    ) -> NodeIds:
        """Reserve CPU blocks for ``hashes`` (a chain continuing ``parent``).

        Returns the pending, locked nodes created: fewer than ``hashes`` (a
        prefix of them) when the CPU tier has no more evictable blocks, or when a
        hash is already indexed (a collision: the chain stops before it rather
        than shadow another block). Eviction decisions are appended to ``moves``.
        """
        k = len(hashes)
        if not k:
            return NO_NODES
        keys = self.keys(hashes) if keys is None else keys
        present = self._table.lookup(keys) >= 0
        if present.any():
            k = int(present.argmax())
        if not k:
            return NO_NODES
        if parent is not None:
            self._locks_v[parent] += 1  # the parent must survive the evictions below
        try:
            free = self.free[Tier.CPU]
            while len(free) < k and self._evict_one(Tier.CPU, moves):
                pass
            k = min(k, len(free))
            if not k:
                return NO_NODES
            blocks = free.take(k)
            top = self._nfree_ids
            ids = self._free_ids[top - k:top][::-1].copy()  # never short: a node per block
            self._nfree_ids = top - k
            prev = -1 if parent is None else parent
            self._clock += 1
            self._gen[ids] += 1
            par = np.empty(k, dtype=np.int64)
            par[0] = prev
            par[1:] = ids[:-1]
            self._parent[ids] = par
            for kids in (self._children, self._cpu_children):
                kids[ids] = 1
                kids[ids[-1]] = 0
            self._tier[ids] = _CPU
            self._block[ids] = blocks
            self._locks[ids] = 1
            self._visible[ids] = 0
            self._tick[ids] = self._clock
            self._key[ids] = keys[:k]
            self._table.insert(keys[:k], ids)
            if self._wide:
                hash_ = self._hash
                for i, h in zip(ids.tolist(), hashes[:k], strict=True):
                    hash_[i] = h
            if prev >= 0:
                self._children_v[prev] += 1
                self._cpu_children_v[prev] += 1
            return ids
        finally:
            if parent is not None:
                self.unlock([parent])

    def node_keys(self, nodes: NodeIds | Iterable[NodeId]) -> Keys:
        """The table keys (low 64 bits of the hash) of ``nodes``."""
        return self._key.take(as_node_ids(nodes))

    def node_hashes(self, nodes: NodeIds | Iterable[NodeId]) -> list[int]:
        """The full block hashes of ``nodes`` (their table keys for hashes of 64
        bits or less)."""
        ids = as_node_ids(nodes)
        if self._wide:
            hash_ = self._hash
            return [hash_[i] for i in ids.tolist()]
        return [int(k) for k in self._key.take(ids).tolist()]

    def parent_hash(self, node: NodeId) -> int | None:
        """The full hash of ``node``'s parent (None for the first block of a chain)."""
        p = int(self._parent_v[node])
        return None if p < 0 else self._full_hash(p)

    def generation(self, node: NodeId) -> int:
        """How many times id ``node`` was handed out: an id held across a change
        names the same node only while its generation is unchanged."""
        return int(self._gen_v[node])

    def is_visible(self, node: NodeId) -> bool:
        """Whether id ``node`` is a published block now (pair with :meth:`generation`
        to know it is still the same node)."""
        return bool(self._visible_v[node])

    def publish(self, nodes: NodeIds | Iterable[NodeId]) -> None:
        """Make pending ``nodes`` visible and release their pending pin."""
        ids = as_node_ids(nodes)
        self._clock += 1
        self._visible[ids] = 1
        self._tick[ids] = self._clock
        self._locks[ids] -= 1
        self._offer_all(ids)

    def remove_pending(self, nodes: NodeIds | Sequence[NodeId]) -> None:
        """Forget pending ``nodes`` (a put failed or was discarded): deepest first.

        Ids no longer filed under their hash (removed before, or the index was
        cleared) are skipped.
        """
        ids = as_node_ids(nodes)
        if not len(ids):
            return
        id_list = ids.tolist()
        keys = self._key.take(ids)
        slots = self._table.find(keys)
        filed = np.where(slots >= 0, self._table.lookup_slots(np.maximum(slots, 0)), -1) == ids
        parent = self._parent.take(ids)
        chain = (bool(filed.all()) and bool((parent[1:] == ids[:-1]).all())
                 and self._children_v[id_list[-1]] == 0
                 and bool((self._children.take(ids[:-1]) == 1).all())
                 and not self._visible.take(ids).any()
                 and not (self._tier.take(ids) != _CPU).any())
        if not chain:  # not one pending run: the general per-node path
            for i in reversed(id_list):
                if self._table.get(self._key_v[i]) == i:
                    self._locks_v[i] = 0
                    self._remove(i)
            return
        # One pending run of CPU blocks: remove it at once.
        self._table.delete_at(slots, keys)
        self.free[Tier.CPU].extend(self._block.take(ids[::-1]).astype(np.int64))
        self._visible[ids] = 0
        self._locks[ids] = 0
        self._gen[ids] += 1
        top, k = self._nfree_ids, len(ids)
        self._free_ids[top:top + k] = ids
        self._nfree_ids = top + k
        p = int(parent[0])
        if p >= 0:
            self._children_v[p] -= 1
            self._cpu_children_v[p] -= 1
            self._offer(p)

    def reserve_ssd(self, blocks: Sequence[int]) -> None:
        """Take SSD ``blocks`` out of the free ring until :meth:`adopt` decides on them
        (a persistent tier's recorded blocks, while they are verified). Only before
        any SSD block is used."""
        if self.used(Tier.SSD):
            raise ValueError(f"reserve_ssd needs an unused SSD tier; {self.used(Tier.SSD)} "
                             "blocks are in use")
        ring = self.free[Tier.SSD]
        ring.take(len(ring))
        ring.extend(np.setdiff1d(np.arange(self.capacity[Tier.SSD], dtype=np.int64),
                                 np.asarray(blocks, dtype=np.int64)))

    def adopt(self, blocks: Sequence[tuple[int, int | None, int, int]],
              reserved: Sequence[int]) -> int:
        """Index recovered SSD blocks as visible nodes; free the rest of ``reserved``.

        ``blocks`` are ``(hash, parent hash or None, ssd block, write sequence)``,
        every parent before its children, each block one of ``reserved``
        (:meth:`reserve_ssd`). A block is adopted only when its hash is not indexed
        yet (not stored again meanwhile) and its parent is a visible node (adopted
        before it, or cached meanwhile), so the index stays a prefix tree; the
        others' blocks return to the free ring. Adopted blocks are older, for LRU,
        than every block indexed before, in write order. Returns how many were
        adopted."""
        pos: dict[int, int] = {}
        taken: set[int] = set()
        hashes: list[int] = []
        parents: list[int] = []  # >= 0: an indexed node; -1: none; <= -2: -2 - position
        where: list[int] = []
        seqs: list[int] = []
        allowed = set(reserved)
        for h, parent, block, seq in blocks:
            key = (h & ((1 << 64) - 1)) or ZERO_STANDIN
            if key in taken or block not in allowed or self._lookup1(h) >= 0:
                continue
            if parent is None:
                par = -1
            elif parent in pos:
                par = -2 - pos[parent]
            else:
                par = self._lookup1(parent)
                if par < 0 or not self._visible_v[par]:
                    continue
            pos[h] = len(hashes)
            taken.add(key)
            allowed.discard(block)
            parents.append(par)
            hashes.append(h)
            where.append(block)
            seqs.append(seq)
        self.free[Tier.SSD].extend(np.array(sorted(allowed), dtype=np.int64))
        k = len(hashes)
        if not k:
            return 0
        top = self._nfree_ids
        ids = self._free_ids[top - k:top][::-1].copy()
        self._nfree_ids = top - k
        par_ids = np.array(parents, dtype=np.int64)
        inner = par_ids <= -2
        par_ids[inner] = ids[-2 - par_ids[inner]]
        self._parent[ids] = par_ids
        self._children[ids] = 0
        self._cpu_children[ids] = 0
        np.add.at(self._children, par_ids[par_ids >= 0], 1)
        self._tier[ids] = _SSD
        self._block[ids] = where
        self._locks[ids] = 0
        self._visible[ids] = 1
        self._tick[ids] = np.argsort(np.argsort(np.array(seqs, dtype=np.int64))) - k
        self._gen[ids] += 1
        keys = as_keys(hashes, self._wide)
        self._key[ids] = keys
        self._table.insert(keys, ids)
        if self._wide:
            hash_ = self._hash
            for i, h in zip(ids.tolist(), hashes, strict=True):
                hash_[i] = h
        self._offer_all(ids)
        return k

    def enforce_watermarks(self, moves: list[TierMove]) -> None:
        """Evict tiers above the high watermark down to the low watermark."""
        for tier in (Tier.CPU, Tier.SSD):
            cap = self.capacity[tier]
            if cap and self.used(tier) > self.high * cap:
                target = int(self.low * cap)
                while self.used(tier) > target and self._evict_one(tier, moves):
                    pass

    def empty_cpu(self, keep_going: Callable[[], bool]) -> tuple[int, int]:
        """Evict CPU blocks, one by one by the usual rules (spill where the SSD tier has
        or can make room, else drop a leaf), until none is evictable or ``keep_going()``
        is false; returns ``(spilled, dropped)``. For a clean stop of a persistent SSD
        tier: what is spilled survives the restart."""
        moves: list[TierMove] = []
        while self.used(Tier.CPU) and keep_going() and self._evict_one(Tier.CPU, moves):
            pass
        cpu = [m for m in moves if m.src.tier is Tier.CPU]
        spilled = sum(1 for m in cpu if m.dst is not None)
        return spilled, len(cpu) - spilled

    def clear(self) -> None:
        """Forget every block (a flush); ids handed out before are void (``epoch`` moves)."""
        self.epoch += 1
        self._gen[self._alive()] += 1
        self._reset_state()

    def check_consistency(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (for tests and
        debugging; O(nodes)): every node's parent is cached, child counts are exact,
        no block is held twice or lost, no pin count is negative."""
        ids = self._table.ids()
        filed = self._table.lookup(self._key.take(ids))
        if not (filed == ids).all():
            j = int((filed != ids).argmax())
            raise AssertionError(
                f"node {int(ids[j])} is filed under {int(self._key[ids[j]]):#x} but a lookup "
                f"of that key finds {int(filed[j])}"
            )
        keys = self._key.tolist()
        alive = {keys[i]: i for i in ids.tolist()}
        parent, children, cpu_children = (self._parent.tolist(), self._children.tolist(),
                                          self._cpu_children.tolist())
        tier, block, locks = self._tier.tolist(), self._block.tolist(), self._locks.tolist()
        kids: dict[int, int] = {}
        cpu_kids: dict[int, int] = {}
        held: dict[int, set[int]] = {_CPU: set(), _SSD: set()}
        if len(alive) != len(ids):
            raise AssertionError(f"{len(ids)} nodes share {len(alive)} keys")
        for i in alive.values():
            if self._wide and (self._hash[i] & ((1 << 64) - 1) or ZERO_STANDIN) != keys[i]:
                raise AssertionError(
                    f"node {i} is filed under {keys[i]:#x} but hashes {self._hash[i]:#x}"
                )
            p = parent[i]
            if p >= 0:
                if alive.get(keys[p]) != p:
                    raise AssertionError(f"node {i} has parent {p}, which is not cached")
                kids[p] = kids.get(p, 0) + 1
                if tier[i] == _CPU:
                    cpu_kids[p] = cpu_kids.get(p, 0) + 1
            if block[i] in held[tier[i]]:
                raise AssertionError(f"block {block[i]} of tier {tier[i]} held twice")
            held[tier[i]].add(block[i])
            if locks[i] < 0:
                raise AssertionError(f"node {i} has {locks[i]} pins")
        for i in alive.values():
            if children[i] != kids.get(i, 0) or cpu_children[i] != cpu_kids.get(i, 0):
                raise AssertionError(
                    f"node {i} counts {children[i]}/{cpu_children[i]} children, "
                    f"has {kids.get(i, 0)}/{cpu_kids.get(i, 0)}"
                )
        for code, t in enumerate(_TIER_OF):
            free = list(self.free[t])
            cap = self.capacity[t]
            if len(set(free)) != len(free) or set(free) & held[code]:
                raise AssertionError(f"{t.value} free list holds a duplicate or a used block")
            if len(free) + len(held[code]) != cap or any(not 0 <= b < cap for b in free):
                raise AssertionError(
                    f"{t.value}: {len(held[code])} held + {len(free)} free != {cap} blocks"
                )
        unused = set(self._free_ids[: self._nfree_ids].tolist())
        if len(unused) != self._nfree_ids or unused & set(alive.values()) \
                or len(unused) + len(alive) != self._n:
            raise AssertionError(
                f"{len(alive)} nodes + {self._nfree_ids} unused ids != {self._n} ids, "
                "or an id is both"
            )

    # -- eviction -----------------------------------------------------------

    def _alive(self) -> NodeIds:
        return self._table.ids()

    def _lookup(self, hashes: Sequence[int], keys: Keys) -> NodeIds:
        """Ids of ``hashes`` (-1 where absent); wide hashes are checked in full."""
        ids = self._table.lookup(keys)
        if self._wide:
            hash_ = self._hash
            for j, (i, h) in enumerate(zip(ids.tolist(), hashes, strict=True)):
                if i >= 0 and hash_[i] != h:
                    ids[j] = -1
        return ids

    def _full_hash(self, i: NodeId) -> int:
        return self._hash[i] if self._wide else int(self._key_v[i])

    def _lookup1(self, h: int) -> NodeId:
        key = h & ((1 << 64) - 1) or ZERO_STANDIN
        i = self._table.get(key)
        if i >= 0 and self._wide and self._hash[i] != h:
            return -1
        return i

    def _location(self, flat: int) -> BlockLocation:
        loc = self._locs[flat]
        if loc is None:
            cpu = self.capacity[Tier.CPU]
            loc = BlockLocation(Tier.CPU, flat) if flat < cpu else \
                BlockLocation(Tier.SSD, flat - cpu)
            self._locs[flat] = loc
            self._made[flat] = True
        return loc

    def _make_locations(self, flat: NodeIds) -> None:
        """Build and cache the location of each flat block number of ``flat``
        (CPU blocks, then SSD blocks, as :meth:`_location` numbers them) at once."""
        cpu = self.capacity[Tier.CPU]
        ssd = flat >= cpu
        for tier, sel in ((Tier.CPU, flat[~ssd]), (Tier.SSD, flat[ssd])):
            if not len(sel):
                continue
            ks = sel.tolist()
            base = 0 if tier is Tier.CPU else cpu
            for k, loc in zip(ks, block_locations(tier, [k - base for k in ks]), strict=True):
                self._locs[k] = loc
        self._made[flat] = True

    def _evict_one(self, tier: Tier, moves: list[TierMove]) -> bool:
        """Free one block of ``tier``; False when every block there is pinned or interior."""
        if tier is Tier.CPU and self.capacity[Tier.SSD]:
            i = self._pop(self._spill, self._spillable)
            if i is not None:
                free_ssd = self.free[Tier.SSD]
                if len(free_ssd) or self._evict_one(Tier.SSD, moves):
                    dst = free_ssd.popleft()
                    src = self.location(i)
                    move = TierMove(src, self._location(self.capacity[Tier.CPU] + dst))
                    try:
                        self._mover(move)  # copy first: the index changes only once it holds
                    except OSError as e:
                        free_ssd.appendleft(dst)
                        self.spill_failures += 1
                        log.error("Spill to SSD failed; dropping a CPU block instead",
                                  extra={"src": src.index, "dst": dst, "error": str(e)})
                    else:
                        if self.on_cpu_evict is not None and self._visible_v[i]:
                            self.on_cpu_evict(self._full_hash(i), src.index)
                        p = self._parent_v[i]
                        if self.on_spill is not None:
                            self.on_spill(self._full_hash(i),
                                          self._full_hash(p) if p >= 0 else None, dst)
                        if self.on_move is not None:
                            self.on_move(self._full_hash(i), Tier.CPU, Tier.SSD)
                        self._tier_v[i], self._block_v[i] = _SSD, dst
                        if p >= 0:
                            self._cpu_children_v[p] -= 1
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
        if code == _CPU and self.on_cpu_evict is not None and self._visible_v[i]:
            self.on_cpu_evict(self._full_hash(i), int(self._block_v[i]))
        moves.append(TierMove(self.location(i), None))
        if self.on_move is not None:
            self.on_move(self._full_hash(i), tier, None)
        self.evictions[tier] += 1
        self._remove(i)
        return True

    def _remove(self, i: NodeId) -> None:
        self._table.delete(self._key_v[i])
        code, block = self._tier_v[i], self._block_v[i]
        self.free[_TIER_OF[code]].append(block)
        self._visible_v[i] = 0
        self._locks_v[i] = 0
        self._gen_v[i] += 1  # voids heap entries of this id
        self._free_ids_v[self._nfree_ids] = i
        self._nfree_ids += 1
        p = self._parent_v[i]
        if p >= 0:
            self._children_v[p] -= 1
            if code == _CPU:
                self._cpu_children_v[p] -= 1
            self._offer(p)

    def _spillable(self, i: NodeId) -> bool:
        return bool(self._visible_v[i] and not self._locks_v[i] and self._tier_v[i] == _CPU
                    and not self._cpu_children_v[i])

    def _droppable(self, i: NodeId, code: int) -> bool:
        return bool(self._visible_v[i] and not self._locks_v[i] and not self._children_v[i]
                    and self._tier_v[i] == code)

    def _offer_all(self, ids: NodeIds) -> None:
        """Offer those of ``ids`` that can be candidates now (few: leaves, spill heads)."""
        cand = ids[(self._locks.take(ids) == 0) & (self._visible.take(ids) != 0)
                   & ((self._children.take(ids) == 0) | (self._cpu_children.take(ids) == 0))]
        for i in cand.tolist():
            self._offer(i)

    def _offer(self, i: NodeId) -> None:
        """Queue node ``i`` as an eviction candidate if it is one now (hot path: lean)."""
        if self._locks_v[i] or not self._visible_v[i]:
            return
        on_cpu = self._tier_v[i] == _CPU
        spill = on_cpu and not self._cpu_children_v[i]
        drop = not self._children_v[i]
        if not (spill or drop):
            return
        entry = (self._tick_v[i], next(self._seq), i, self._gen_v[i])
        if spill:
            heapq.heappush(self._spill, entry)
            self._entries += 1
        if drop:
            heapq.heappush(self._drop_cpu if on_cpu else self._drop_ssd, entry)
            self._entries += 1
        if self._entries > 4 * self._table.count + 4096:
            self._rebuild()

    def _pop(self, heap: list[_Entry], check: Callable[[NodeId], bool]) -> NodeId | None:
        tick, gen = self._tick_v, self._gen_v
        while heap:
            t, _, i, g = heapq.heappop(heap)
            if gen[i] == g and tick[i] == t and check(i):
                return i
        return None

    def _rebuild(self) -> None:
        """Drop stale heap entries: re-offer every candidate from scratch (vectorised)."""
        ids = self._alive()
        ids = ids[(self._visible.take(ids) != 0) & (self._locks.take(ids) == 0)]
        on_cpu = self._tier.take(ids) == _CPU
        leaf = self._children.take(ids) == 0
        spill = ids[on_cpu & (self._cpu_children.take(ids) == 0)]
        drop_cpu, drop_ssd = ids[on_cpu & leaf], ids[~on_cpu & leaf]

        def entries(sel: NodeIds) -> list[_Entry]:
            out = list(zip(self._tick.take(sel).tolist(), self._seq, sel.tolist(),
                           self._gen.take(sel).tolist(), strict=False))
            heapq.heapify(out)
            return out

        self._spill, self._drop_cpu, self._drop_ssd = (
            entries(spill), entries(drop_cpu), entries(drop_ssd))
        self._entries = len(self._spill) + len(self._drop_cpu) + len(self._drop_ssd)

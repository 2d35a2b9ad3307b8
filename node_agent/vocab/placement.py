"""Where a block lives and how a leader's decision moves it: the placement words
the backends, the coordinator and the fan-out codec share.

A store or load is a :class:`TransferPlan` (the tier blocks of each masked block, in
token order); tier movement (a CPU block spilled to SSD, a block dropped) is a
:class:`TierMove`. How a PP group uses them: :mod:`node_agent.backend.replication`
and docs/pp.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(enum.Enum):
    """A cache tier of a stage."""

    CPU = "cpu"
    SSD = "ssd"
    #: The shared pool (node_agent/backend/remote). Only in tier moves: REMOTE -> CPU
    #: (fetch; the source index is the remote block id) and CPU -> REMOTE (write).
    REMOTE = "remote"

    # Members are singletons compared by identity; hashing by identity too keeps
    # BlockLocation hashing off Enum's Python-level __hash__ (index hot path).
    __hash__ = object.__hash__


class Direction(enum.Enum):
    """Which way a plan moves KV: engine slots to tiers (STORE) or back (LOAD)."""

    STORE = "store"
    LOAD = "load"


@dataclass(frozen=True, order=True, slots=True)
class BlockLocation:
    """One physical block of a tier: ``index`` in ``[0, num_blocks(tier))``."""

    tier: Tier
    index: int


_NEW = object.__new__
_SET_TIER = vars(BlockLocation)["tier"].__set__  # the slot descriptors
_SET_INDEX = vars(BlockLocation)["index"].__set__


def block_locations(tier: Tier, indices: list[int]) -> list[BlockLocation]:
    """``[BlockLocation(tier, i) for i in indices]``, built without the frozen
    dataclass's ``__init__`` (its two ``object.__setattr__`` calls cost about
    twice as much as filling the slots directly): the objects are equal, hash
    alike and stay immutable. For the index's plan building, which makes a
    location per new block (128 for a 2048-token store)."""
    out = []
    for i in indices:
        loc = _NEW(BlockLocation)
        _SET_TIER(loc, tier)
        _SET_INDEX(loc, i)
        out.append(loc)
    return out


@dataclass(frozen=True)
class TransferPlan:
    """What one stage copies for one task.

    ``blocks[i]`` is where the i-th masked block of the task lives (LOAD) or will
    live (STORE). The slot mapping executed with the plan holds
    ``len(blocks) * tokens_per_block`` slots in token order.
    """

    direction: Direction
    blocks: tuple[BlockLocation, ...]


@dataclass(frozen=True)
class TierMove:
    """A leader decision to move a block between tiers, or drop it (``dst`` None).

    Dropping needs no copy; moving copies the stage's own bytes of ``src`` to
    ``dst``. Every stage applies moves in stream order, before any later plan.
    """

    src: BlockLocation
    dst: BlockLocation | None

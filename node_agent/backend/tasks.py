"""Tasks of the embedded backend: a matched span, its plan, and where it stands."""

from __future__ import annotations

import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from node_agent.backend.base import BoolMask, KVResponse, KVResponseStatus, TokenArray
from node_agent.backend.index import NodeIds
from node_agent.vocab.placement import Direction, TransferPlan


class TaskState(enum.Enum):
    """Lifecycle: MATCHED -> LAUNCHED -> DONE, MATCHED -> CLAIMED -> DONE (a get the
    engine copies itself), or MATCHED -> DONE (cancelled, expired)."""

    MATCHED = "matched"
    LAUNCHED = "launched"
    CLAIMED = "claimed"
    DONE = "done"


@dataclass(eq=False)
class Task:
    """One get, put, or batch of them.

    ``nodes`` are the index node ids the task pins (loaded blocks for a get,
    pending blocks for a put), valid while the index is in ``epoch``. A batch has
    ``members`` and no plan of its own.
    """

    id: int
    direction: Direction | None
    mask: BoolMask | None
    nodes: NodeIds
    plan: TransferPlan | None
    deadline: float
    state: TaskState = TaskState.MATCHED
    status: KVResponseStatus | None = None
    error: str | None = None
    finished_at: float = 0.0
    members: list[Task] = field(default_factory=list)
    batch: Task | None = None
    future: Future[None] | None = None
    epoch: int = 0
    """The index epoch the nodes belong to; after a reset they are void."""
    abort: threading.Event = field(default_factory=threading.Event)
    """Set to stop the task's copy (cancel, discard, reset, shutdown); a task whose
    flag is set when its copy ends finishes CANCELLED."""
    discarded: bool = False
    """A put discarded while copying: its pending blocks are freed when it ends."""
    tenant: int = 0
    """The stage whose engine buffers the task copies from / to (a backend shared
    by several stages, :mod:`node_agent.backend.shared`; 0 for a backend's own)."""
    tokens: TokenArray | None = None
    """A put's tokens of its ``nodes``, in order (kept only when KV events are on)."""
    fence: int | None = None
    """A claimed get's CPU tier claim fence when it was claimed (None: not claimed,
    or a tier without a fence)."""

    @property
    def is_put(self) -> bool:
        """True for a store task."""
        return self.direction is Direction.STORE

    def response(self) -> KVResponse:
        """The terminal response of this task."""
        assert self.status is not None
        ok = self.status is KVResponseStatus.SUCCESS
        ret = None
        if self.mask is not None:
            ret = self.mask.copy() if ok else self.mask & False
        return KVResponse(self.status, self.id, ret, self.error)

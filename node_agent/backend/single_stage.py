"""A plain :class:`KVBackend` serving a PP group of one stage.

The connector's leader speaks :class:`~node_agent.backend.replication.ReplicatedBackend`
(physical plans, tier moves, deferred visibility) because in a group of several
stages every follower must replay its decisions. A group of ONE stage has no
follower to replay anything, so any FlexKV-shaped backend can serve it, the
``flexkv`` adapter included. :class:`SingleStageBackend` supplies the replication
hooks for that case:

* ``plan_of`` answers an empty plan of the task's direction: no follower reads it;
* ``drain_moves`` answers nothing: tier movement stays inside the backend;
* ``publish`` is a no-op and ``discard`` cancels: the wrapped backend already makes
  a put visible when its only stage finished it, which is exactly "every stage
  stored it" (docs/pp.md, "Stores, loads and acks") for a group of one.

Using it for a group of more than one stage would let followers miss decisions,
so the agent builds it only for ``ppSize`` 1 (and refuses ``backend: flexkv``
otherwise, with an error that says so).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from node_agent.backend.base import (
    BackendStats,
    BoolMask,
    KVBackend,
    KVResponse,
    MatchOp,
    SlotArray,
    TaskNotFoundError,
    TokenArray,
)
from node_agent.backend.replication import ReplicatedBackend
from node_agent.vocab.placement import Direction, TierMove, TransferPlan


class SingleStageBackend(ReplicatedBackend):
    """Delegates the FlexKV contract to ``inner``; replication hooks for one stage."""

    def __init__(self, inner: KVBackend, namespace: str | None = None) -> None:
        self.inner = inner
        self.namespace = namespace
        """The stage's model namespace, given to ``inner`` when a call names none."""
        self.tokens_per_block = inner.tokens_per_block
        self._lock = threading.Lock()
        # Direction of every matched task not yet reaped, for plan_of.
        self._directions: dict[int, Direction] = {}

    # -- replication hooks -------------------------------------------------

    def plan_of(self, task_id: int) -> TransferPlan:
        with self._lock:
            direction = self._directions.get(task_id)
        if direction is None:
            raise TaskNotFoundError(
                f"task {task_id} is not a matched task of this stage; use the id returned "
                "by get_match/put_match"
            )
        return TransferPlan(direction, ())

    def drain_moves(self) -> list[TierMove]:
        return []

    def publish(self, task_id: int) -> None:
        with self._lock:
            self._directions.pop(task_id, None)

    def discard(self, task_id: int) -> None:
        with self._lock:
            self._directions.pop(task_id, None)
        self.inner.cancel([task_id])

    # -- the FlexKV contract, delegated --------------------------------------

    def register_kv_buffers(self, rank: int, buffers: Sequence[Sequence[torch.Tensor]]) -> None:
        self.inner.register_kv_buffers(rank, buffers)

    def start(self) -> None:
        self.inner.start()

    def is_ready(self) -> bool:
        return self.inner.is_ready()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def reset(self) -> None:
        with self._lock:
            self._directions.clear()
        self.inner.reset()

    def stats(self) -> BackendStats:
        return self.inner.stats()

    def _match(self, op: MatchOp, tokens: TokenArray, token_mask: BoolMask | None,
               namespace: str | None) -> tuple[int, BoolMask]:
        """The inner backend's match under the stage's namespace (when the call
        names none); the task's direction is remembered for ``launch``."""
        match = self.inner.get_match if op == "get" else self.inner.put_match
        task_id, mask = match(tokens, token_mask, namespace or self.namespace)
        self._remember(task_id, Direction.LOAD if op == "get" else Direction.STORE)
        return task_id, mask

    def _launch(self, ids: list[int], slot_mappings: Sequence[SlotArray],
                as_batch: bool) -> list[int]:
        return self.inner.launch(ids, slot_mappings, as_batch)

    def _wait(self, ids: list[int], timeout: float, completely: bool) -> dict[int, KVResponse]:
        answers = self.inner.wait(ids, timeout, completely)
        self._forget_terminal(answers)
        return answers

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, KVResponse]:
        answers = self.inner.try_wait(task_ids)
        self._forget_terminal(answers)
        return answers

    def cancel(self, task_ids: Sequence[int]) -> None:
        with self._lock:
            for t in task_ids:
                self._directions.pop(int(t), None)
        self.inner.cancel(task_ids)

    # -- bookkeeping -------------------------------------------------------

    def _remember(self, task_id: int, direction: Direction) -> None:
        if task_id >= 0:
            with self._lock:
                self._directions[task_id] = direction

    def _forget_terminal(self, answers: dict[int, KVResponse]) -> None:
        # A put stays known until publish/discard: the leader asks for nothing
        # more about it, but discard after a terminal wait must still cancel.
        with self._lock:
            for tid, resp in answers.items():
                if resp.status.terminal and self._directions.get(tid) is Direction.LOAD:
                    del self._directions[tid]

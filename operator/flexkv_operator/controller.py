"""The work queue: which pools to reconcile, when, and one at a time per pool.

Watch events (pools, agent Leases, agent DaemonSets) only record what they saw
and mark pools due; a single loop reconciles due pools (a bounded number in
parallel, never the same pool twice at once). A pool is also due when the
earliest heartbeat of its fresh agents would expire, so a lost leader is
noticed one lease duration after its last renewal, and every ``resync_seconds``.
Failed reconciles are retried with capped exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from flexkv_operator import names
from flexkv_operator.context import OperatorContext
from flexkv_operator.reconcile import PoolGone, ReconcileResult, reconcile_pool

logger = logging.getLogger(__name__)

PoolKey = tuple[str, str]
Reconciler = Callable[[OperatorContext, dict[str, Any]], Awaitable[ReconcileResult]]


def _intent(body: dict[str, Any]) -> tuple[Any, ...]:
    """What a pool asks for; a change of status or resourceVersion alone (our own
    status writes) does not need a reconcile."""
    meta = body.get("metadata") or {}
    return (
        body.get("spec"),
        meta.get("generation"),
        meta.get("uid"),
        meta.get("labels"),
        meta.get("deletionTimestamp"),
    )


@dataclass
class Controller:
    ctx: OperatorContext
    reconciler: Reconciler = reconcile_pool
    concurrency: int = 4
    max_backoff: float = 30.0
    pools: dict[PoolKey, dict[str, Any]] = field(default_factory=dict)
    due: dict[PoolKey, float] = field(default_factory=dict)
    failures: dict[PoolKey, int] = field(default_factory=dict)
    last_result: dict[PoolKey, ReconcileResult] = field(default_factory=dict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _running: set[PoolKey] = field(default_factory=set)

    def _mark(self, key: PoolKey, delay: float = 0.0) -> None:
        if key not in self.pools:
            return
        at = self.ctx.clock() + delay
        self.due[key] = min(self.due.get(key, at), at)
        self._wake.set()

    def observe_pool(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            self.forget_pool(key)
            return
        previous = self.pools.get(key)
        self.pools[key] = body
        if previous is None or _intent(previous) != _intent(body):
            self._mark(key)

    def forget_pool(self, key: PoolKey) -> None:
        """Stop reconciling a deleted pool; its children go with it through owner references."""
        if self.pools.pop(key, None) is not None:
            logger.info("Pool deleted; forgetting it", extra={"namespace": key[0], "pool": key[1]})
        self.due.pop(key, None)
        self.failures.pop(key, None)
        self.last_result.pop(key, None)
        self.ctx.tracker.forget_pool(*key)
        self.ctx.group_names.pop(key, None)
        if self.ctx.groups is not None:
            self.ctx.groups.forget_pool(*key)

    def observe_lease(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        namespace = str(meta.get("namespace"))
        if event_type == "DELETED":
            record = self.ctx.tracker.forget(namespace, str(meta.get("name")))
            if record is not None:
                self._mark((namespace, record.pool))
            return
        before = self.ctx.tracker.pool_of(namespace, str(meta.get("name")))
        if self.ctx.tracker.observe(body):
            pool = ((meta.get("labels") or {}).get(names.LABEL_POOL)) or ""
            self._mark((namespace, pool))
            if before is not None and before != pool:
                self._mark((namespace, before))  # the pool that lost the Lease

    def observe_owned(self, body: dict[str, Any]) -> None:
        """A child (the agents' DaemonSet) changed: its pool may change phase."""
        meta = body.get("metadata") or {}
        pool = (meta.get("labels") or {}).get(names.LABEL_POOL)
        if pool:
            self._mark((str(meta.get("namespace")), pool))

    async def _run_one(self, key: PoolKey) -> None:
        body = self.pools.get(key)
        if body is None:
            return
        try:
            result = await self.reconciler(self.ctx, body)
        except asyncio.CancelledError:
            raise
        except PoolGone:
            if self.pools.get(key) is body:  # not re-created meanwhile
                self.forget_pool(key)
            return
        except Exception as exc:
            count = self.failures.get(key, 0) + 1
            self.failures[key] = count
            delay = min(0.5 * 2 ** (count - 1), self.max_backoff)
            logger.warning(
                "Reconcile failed; retrying",
                extra={"namespace": key[0], "pool": key[1], "error": repr(exc), "retry_in": delay},
            )
            self._mark(key, delay)
            return
        self.failures.pop(key, None)
        self.last_result[key] = result
        self._mark(key, result.next_in)

    async def run(self) -> None:
        """Reconcile due pools until cancelled."""
        tasks: dict[PoolKey, asyncio.Task[None]] = {}
        try:
            while True:
                now = self.ctx.clock()
                ready = sorted(
                    (at, key) for key, at in self.due.items() if at <= now and key not in tasks
                )
                for _, key in ready[: max(0, self.concurrency - len(tasks))]:
                    del self.due[key]
                    tasks[key] = asyncio.create_task(self._run_one(key))
                # Due keys only set a timeout while a slot is free: a due key that
                # cannot start now waits for a running task to finish (which wakes
                # the wait), never for a zero timeout (a busy loop).
                free = len(tasks) < self.concurrency
                pending_due = [at for key, at in self.due.items() if key not in tasks and free]
                timeout = max(0.0, min(pending_due) - now) if pending_due else None
                self._wake.clear()
                wake = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait(
                        [wake, *tasks.values()],
                        timeout=timeout,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    wake.cancel()
                for key in [k for k, t in tasks.items() if t.done()]:
                    tasks.pop(key)
        finally:
            for task in tasks.values():
                task.cancel()
            for task in tasks.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

"""The work queue: which pools to reconcile, when, and one at a time per pool.

Watch events (pools, agent Leases, agent DaemonSets) only record what they saw
and mark pools due; a single loop runs two kinds of work per pool, each on its
own timer:

* the **full reconcile** (spec, children, status): a bounded number in parallel,
  never the same pool twice at once, due on changes, every ``resync_seconds``,
  and after a failure with capped exponential backoff (0.5 s doubling to
  ``max_backoff``);
* the **group pass** (election and publication only, :func:`sync_groups`): due
  when the earliest heartbeat of the pool's fresh agents expires, so a lost
  leader is replaced one lease duration after its last renewal, whatever happens
  to the full reconcile (invalid spec, a child refused, backoff). A failed pass
  is retried after at most ``group_retry_max`` seconds and re-reads the pool's
  Leases first, so failover resumes within that time of the API server coming
  back.
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
from flexkv_operator.reconcile import (
    GroupSync,
    PoolGone,
    ReconcileResult,
    reconcile_pool,
    sync_groups,
)

logger = logging.getLogger(__name__)

PoolKey = tuple[str, str]
Reconciler = Callable[[OperatorContext, dict[str, Any]], Awaitable[ReconcileResult]]
GroupSyncer = Callable[[OperatorContext, dict[str, Any], bool], Awaitable[GroupSync]]
TaskKey = tuple[str, PoolKey]  # ("full" | "groups", pool)


async def _sync_groups(ctx: OperatorContext, body: dict[str, Any], relist: bool) -> GroupSync:
    return await sync_groups(ctx, body, relist=relist)


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
    group_syncer: GroupSyncer = _sync_groups
    concurrency: int = 4
    group_concurrency: int = 16
    max_backoff: float = 30.0
    group_retry_max: float = 1.0
    pools: dict[PoolKey, dict[str, Any]] = field(default_factory=dict)
    due: dict[PoolKey, float] = field(default_factory=dict)
    failures: dict[PoolKey, int] = field(default_factory=dict)
    last_result: dict[PoolKey, ReconcileResult] = field(default_factory=dict)
    group_due: dict[PoolKey, float] = field(default_factory=dict)
    group_failures: dict[PoolKey, int] = field(default_factory=dict)
    group_signature: dict[PoolKey, tuple[object, ...]] = field(default_factory=dict)
    last_error: dict[PoolKey, str] = field(default_factory=dict)
    # Whether this replica may act (holds the operator Lease); a standby only watches.
    active: Callable[[], bool] = lambda: True
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def leadership_changed(self, active: bool) -> None:
        """Called by the operator's leader election: a replica that becomes active
        looks at every pool at once (its watches kept the view current)."""
        if active:
            for key in list(self.pools):
                self._mark_both(key)
        self._wake.set()

    def _mark(self, key: PoolKey, delay: float = 0.0, *, groups: bool = False) -> None:
        """Make the pool's full reconcile (or, with ``groups``, its group pass) due in
        ``delay`` seconds, unless it is due earlier already."""
        if key not in self.pools:
            return
        due = self.group_due if groups else self.due
        at = self.ctx.clock() + delay
        due[key] = min(due.get(key, at), at)
        self._wake.set()

    def _mark_both(self, key: PoolKey) -> None:
        self._mark(key)
        self._mark(key, groups=True)

    def observe_pool(self, event_type: str | None, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            self.forget_pool(key)
            return
        previous = self.pools.get(key)
        self.pools[key] = body
        if previous is None or _intent(previous) != _intent(body):
            self._mark_both(key)

    def forget_pool(self, key: PoolKey) -> None:
        """Stop reconciling a deleted pool; its children go with it through owner references."""
        if self.pools.pop(key, None) is not None:
            logger.info("Pool deleted; forgetting it", extra={"namespace": key[0], "pool": key[1]})
        for table in (
            self.due,
            self.failures,
            self.last_result,
            self.group_due,
            self.group_failures,
            self.group_signature,
            self.last_error,
        ):
            table.pop(key, None)
        self.ctx.group_locks.pop(key, None)
        self.ctx.leases_listed.discard(key)
        self.ctx.metrics.set_group_phases(key, None)
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
                self._mark_both((namespace, record.pool))
            return
        before = self.ctx.tracker.pool_of(namespace, str(meta.get("name")))
        if self.ctx.tracker.observe(body):
            pool = ((meta.get("labels") or {}).get(names.LABEL_POOL)) or ""
            self._mark_both((namespace, pool))
            if before is not None and before != pool:
                self._mark_both((namespace, before))  # the pool that lost the Lease

    def observe_owned(self, body: dict[str, Any]) -> None:
        """A child (the agents' DaemonSet) changed: its pool may change phase."""
        meta = body.get("metadata") or {}
        pool = (meta.get("labels") or {}).get(names.LABEL_POOL)
        if pool:
            self._mark((str(meta.get("namespace")), pool))

    def _backoff(self, count: int) -> float:
        return float(min(0.5 * 2 ** (count - 1), self.max_backoff))

    async def _run_one(self, key: PoolKey) -> None:
        body = self.pools.get(key)
        if body is None:
            return
        metrics = self.ctx.metrics
        started = self.ctx.clock()
        try:
            try:
                result = await self.reconciler(self.ctx, body)
            finally:
                metrics.reconcile_seconds.labels("pool").observe(self.ctx.clock() - started)
        except asyncio.CancelledError:
            raise
        except PoolGone:
            if self.pools.get(key) is body:  # not re-created meanwhile
                self.forget_pool(key)
            return
        except Exception as exc:
            metrics.reconciles.labels("pool", "error").inc()
            count = self.failures.get(key, 0) + 1
            self.failures[key] = count
            delay = self._backoff(count)
            self.last_error[key] = str(exc)
            logger.warning(
                "Reconcile failed; retrying",
                extra={"namespace": key[0], "pool": key[1], "error": repr(exc), "retry_in": delay},
            )
            self._mark(key, delay)
            return
        self.last_result[key] = result
        metrics.reconciles.labels("pool", "error" if result.errors else "success").inc()
        if result.errors:
            # Reported in the pool's status and Events by the reconcile; retried with
            # the same capped backoff (the group pass is not affected).
            count = self.failures.get(key, 0) + 1
            self.failures[key] = count
            self.last_error[key] = "; ".join(result.errors)
            self._mark(key, max(self._backoff(count), min(result.next_in, self.max_backoff)))
            return
        self.failures.pop(key, None)
        self.last_error.pop(key, None)
        self._mark(key, result.next_in)

    async def _run_groups(self, key: PoolKey) -> None:
        body = self.pools.get(key)
        if body is None:
            return
        failed_before = self.group_failures.get(key, 0)
        # The first pass of a pool, and the first after a failure, read the pool's Leases
        # first: the Lease watch may not have delivered them all yet (startup) or may
        # have missed renewals (outage), and a group must not lose its members for that.
        relist = failed_before > 0 or key not in self.group_signature
        metrics = self.ctx.metrics
        started = self.ctx.clock()
        try:
            try:
                sync = await self.group_syncer(self.ctx, body, relist)
            finally:
                metrics.reconcile_seconds.labels("groups").observe(self.ctx.clock() - started)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            metrics.reconciles.labels("groups", "error").inc()
            count = failed_before + 1
            self.group_failures[key] = count
            delay = min(0.25 * 2 ** (count - 1), self.group_retry_max)
            logger.warning(
                "Group election failed; retrying",
                extra={"namespace": key[0], "pool": key[1], "error": repr(exc), "retry_in": delay},
            )
            self._mark(key, delay, groups=True)
            return
        metrics.reconciles.labels("groups", "success").inc()
        phases: dict[str, int] = {}
        for outcome in sync.outcomes:
            if outcome.phase:
                phases[outcome.phase] = phases.get(outcome.phase, 0) + 1
        metrics.set_group_phases(key, phases)
        self.group_failures.pop(key, None)
        if failed_before and self.failures.get(key):
            # The API server answers again: the full reconcile need not wait out its backoff.
            self._mark(key)
        elif self.group_signature.get(key) != sync.signature and key in self.group_signature:
            self._mark(key)  # leaders or freshness changed: the pool's status is stale
        self.group_signature[key] = sync.signature
        self._mark(key, sync.next_in, groups=True)

    def _start_due(
        self, tasks: dict[TaskKey, asyncio.Task[None]], kind: str, now: float
    ) -> float | None:
        """Start due work of ``kind`` in free slots; return when the next is due."""
        due = self.group_due if kind == "groups" else self.due
        limit = self.group_concurrency if kind == "groups" else self.concurrency
        running = sum(1 for k in tasks if k[0] == kind)
        ready = sorted(
            (at, key) for key, at in due.items() if at <= now and (kind, key) not in tasks
        )
        for _, key in ready[: max(0, limit - running)]:
            del due[key]
            run = self._run_groups if kind == "groups" else self._run_one
            tasks[(kind, key)] = asyncio.create_task(run(key))
            running += 1
        # Due keys only set a timeout while a slot is free: a due key that cannot
        # start now waits for a running task to finish (which wakes the wait),
        # never for a zero timeout (a busy loop).
        if running >= limit:
            return None
        pending = [at for key, at in due.items() if (kind, key) not in tasks]
        return min(pending) if pending else None

    async def run(self) -> None:
        """Reconcile due pools and run due group passes until cancelled."""
        tasks: dict[TaskKey, asyncio.Task[None]] = {}
        try:
            while True:
                if not self.active():
                    # Standby (or lost the Lease): act on nothing, stop what runs.
                    for task in tasks.values():
                        task.cancel()
                    tasks.clear()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                now = self.ctx.clock()
                nexts = [
                    at
                    for at in (
                        self._start_due(tasks, "groups", now),
                        self._start_due(tasks, "full", now),
                    )
                    if at is not None
                ]
                timeout = max(0.0, min(nexts) - now) if nexts else None
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

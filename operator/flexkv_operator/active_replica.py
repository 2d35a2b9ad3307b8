"""Active/passive operator replicas: a ``coordination.k8s.io/v1`` Lease held by the
active replica, with client-go's leader-election rules.

Every replica runs its watches (so a standby's view of pools and agent Leases is
current), but only the replica holding the Lease reconciles and writes. The
holder renews every ``retry_period``; a standby takes the Lease once it has not
seen it change for its ``leaseDurationSeconds`` (judged by the standby's own
clock, never by comparing timestamps across machines), or at once when the
holder released it on shutdown (empty ``holderIdentity``). Every write is
conditional on the resourceVersion read, so two standbys cannot both take it.
The holder stops acting as soon as it has not renewed for ``renew_deadline``,
which is shorter than the lease duration, so two replicas never act at once.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flexkv_operator.kube import ApiError, Conflict, KubeClient, api_path

logger = logging.getLogger(__name__)

LEASE_API = "coordination.k8s.io/v1"


def _stamp(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaderElection:
    """Acquire and renew the operator's Lease; ``active`` says whether to act now."""

    client: KubeClient
    namespace: str
    name: str
    identity: str
    clock: Callable[[], float]
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    on_change: Callable[[bool], None] = lambda active: None
    wall_clock: Callable[[], datetime.datetime] = field(
        default=lambda: datetime.datetime.now(datetime.UTC)
    )
    transitions: int = 0  # times this replica became active
    _holding: bool = False
    _renewed_at: float | None = None
    _observed: tuple[Any, ...] | None = None
    _observed_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.lease_duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError(
                f"operator leader election needs lease duration ({self.lease_duration}) > "
                f"renew deadline ({self.renew_deadline}) > retry period ({self.retry_period}) > 0; "
                "e.g. 15 > 10 > 2"
            )

    @property
    def active(self) -> bool:
        """True while this replica holds the Lease and renewed it within the deadline."""
        return (
            self._holding
            and self._renewed_at is not None
            and self.clock() - self._renewed_at < self.renew_deadline
        )

    def _set(self, holding: bool) -> None:
        if holding != self._holding:
            self._holding = holding
            if holding:
                self.transitions += 1
            logger.info(
                "Operator leadership changed",
                extra={"identity": self.identity, "active": holding, "lease": self.name},
            )
            self.on_change(holding)

    def _path(self, name: str | None = None) -> str:
        return api_path(LEASE_API, "leases", self.namespace, name)

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = lease.get("spec") or {}
        marker = (
            spec.get("holderIdentity"),
            spec.get("renewTime"),
            (lease.get("metadata") or {}).get("resourceVersion"),
        )
        if marker != self._observed:
            self._observed = marker
            self._observed_at = self.clock()

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards."""
        now = _stamp(self.wall_clock())
        lease = await self.client.get_or_none(self._path(self.name))
        if lease is None:
            body = {
                "apiVersion": LEASE_API,
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {
                    "holderIdentity": self.identity,
                    "leaseDurationSeconds": round(self.lease_duration),
                    "acquireTime": now,
                    "renewTime": now,
                    "leaseTransitions": 0,
                },
            }
            try:
                created = await self.client.create(self._path(), body)
            except Conflict:
                return False  # another replica created it first
            self._observe(created)
            self._renewed_at = self.clock()
            self._set(True)
            return True
        self._observe(lease)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
        if holder and holder != self.identity and self.clock() - self._observed_at < duration:
            self._set(False)
            return False  # held by another replica that renewed within its duration
        new_spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": round(self.lease_duration),
            "renewTime": now,
        }
        if holder != self.identity:
            new_spec["acquireTime"] = now
            new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        patch = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]}}
        try:
            written = await self.client.patch(self._path(self.name), {**patch, "spec": new_spec})
        except Conflict:
            return False  # someone wrote in between: decide again next period
        self._observe(written)
        self._renewed_at = self.clock()
        self._set(True)
        return True

    async def run(self) -> None:
        """Try to acquire, then renew, every ``retry_period`` until cancelled."""
        while True:
            try:
                await asyncio.wait_for(self.try_acquire_or_renew(), self.renew_deadline)
            except asyncio.CancelledError:
                raise
            except (ApiError, TimeoutError) as exc:
                logger.warning(
                    "Operator lease renewal failed",
                    extra={"identity": self.identity, "error": str(exc)},
                )
            # Keep acting until the renew deadline passes without a renewal.
            self._set(self.active)
            await asyncio.sleep(self.retry_period if not self._holding else self._renew_wait())

    def _renew_wait(self) -> float:
        """Sleep until the next renewal, but wake in time to step down at the deadline."""
        if self._renewed_at is None:
            return self.retry_period
        left = self.renew_deadline - (self.clock() - self._renewed_at)
        return max(0.01, min(self.retry_period, left))

    async def release(self) -> None:
        """Give the Lease up on shutdown so a standby takes over at once."""
        if not self._holding:
            return
        self._set(False)
        try:
            lease = await self.client.get_or_none(self._path(self.name))
            spec = (lease or {}).get("spec") or {}
            if lease is None or spec.get("holderIdentity") != self.identity:
                return
            await self.client.patch(
                self._path(self.name),
                {
                    "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                    "spec": {
                        "holderIdentity": "",
                        "leaseDurationSeconds": 1,
                        "renewTime": _stamp(self.wall_clock()),
                    },
                },
            )
        except ApiError as exc:
            logger.warning(
                "Could not release the operator lease",
                extra={"identity": self.identity, "error": str(exc)},
            )

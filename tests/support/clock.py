"""A clock the test moves by hand, for code that takes ``clock=`` (a monotonic
time source): expiry, retry periods and probes are then checked without waiting."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ManualClock:
    """Callable like ``time.monotonic``; returns :attr:`now`, which only the test
    changes (``clock.now += 5``)."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

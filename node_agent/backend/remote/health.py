"""Whether the remote tier's master answers: tracked from call outcomes.

Every remote call reports its outcome. A failure marks the tier down (the gauge
``flexkv_agent_remote_up`` drops to 0 and ``/readyz`` shows the ``remote``
component degraded); while it is down, lookups answer misses without calling the
master, except for one probe every ``retry_seconds``; the first successful call
marks it up again, so the tier resumes by itself when the master returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from node_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)


class RemoteHealth:
    """Up / down state of the remote tier, with a retry gate while down."""

    def __init__(self, metrics: AgentMetrics | None = None, retry_seconds: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._retry = retry_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._up = False
        self._reason = "not connected yet"
        self._next_try = 0.0
        if metrics is not None:
            metrics.remote_up.set(0)
            metrics.init_remote()

    @property
    def up(self) -> bool:
        """Whether the last remote call succeeded."""
        return self._up

    @property
    def reason(self) -> str:
        """Why the tier is down (the last error), or ``ok``."""
        return "ok" if self._up else self._reason

    def should_try(self) -> bool:
        """True when up, or when down and the next probe is due (then it is claimed)."""
        with self._lock:
            if self._up:
                return True
            now = self._clock()
            if now >= self._next_try:
                self._next_try = now + self._retry
                return True
            return False

    def succeeded(self) -> None:
        with self._lock:
            was = self._up
            self._up = True
        if not was:
            log.info("Remote tier is up")
            if self._metrics is not None:
                self._metrics.remote_up.set(1)

    def failed(self, reason: str) -> None:
        with self._lock:
            was = self._up
            self._up = False
            self._reason = reason
            self._next_try = self._clock() + self._retry
        if was:
            log.warning("Remote tier is down; local tiers keep serving", extra={"reason": reason})
        if self._metrics is not None:
            self._metrics.remote_up.set(0)

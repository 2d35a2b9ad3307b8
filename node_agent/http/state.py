"""What the HTTP surface reports: the probe interface the agent implements, and the
bounded log of recent errors every component records into."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Protocol


class AgentProbe(Protocol):
    """The agent as the HTTP routes see it. Every method is cheap and non-blocking."""

    def liveness(self) -> dict[str, bool]:
        """Component name -> its loop or thread is alive."""

    def readiness(self) -> dict[str, dict[str, Any]]:
        """Component name -> ``{"ready": bool, ...detail}``; ready overall when all are."""

    def status(self) -> dict[str, Any]:
        """The /status document: tiers, groups, ranks, recent errors."""


class Service(Protocol):
    """A background service the HTTP lifespan starts and stops."""

    name: str

    async def start(self) -> None:
        """Start; raise to abort the agent's start-up."""

    async def stop(self) -> None:
        """Stop within the service's own bounded grace period."""


class RecentErrors:
    """The last ``maxlen`` errors, newest last; safe to record from any thread."""

    def __init__(self, maxlen: int = 50) -> None:
        self._items: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.total = 0

    def record(self, component: str, message: str) -> None:
        """Remember one error (message truncated to 500 characters)."""
        item = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "component": component, "message": message[:500]}
        with self._lock:
            self._items.append(item)
            self.total += 1

    def snapshot(self) -> list[dict[str, Any]]:
        """A copy of the remembered errors, oldest first."""
        with self._lock:
            return list(self._items)

"""The bounded log of recent errors every component of the agent records into
(shown in /status and the Lease)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any


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

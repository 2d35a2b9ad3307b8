"""What the HTTP surface reports: the probe interface the agent implements and the
services its lifespan runs."""

from __future__ import annotations

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

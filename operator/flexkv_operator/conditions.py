"""Status conditions with Kubernetes semantics: a transition time that moves only
when the status value changes, and the generation the condition was computed for."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool | None  # None is "Unknown"
    reason: str
    message: str


def _status_text(status: bool | None) -> str:
    return "Unknown" if status is None else ("True" if status else "False")


def merge_conditions(
    previous: list[dict[str, Any]] | None,
    updates: list[Condition],
    generation: int,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Return the new conditions list: ``updates`` replace same-type entries, keeping
    ``lastTransitionTime`` when the status did not change; other types are kept."""
    by_type = {c.get("type"): c for c in (previous or []) if isinstance(c, dict)}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    for update in updates:
        old = by_type.get(update.type)
        status = _status_text(update.status)
        transition = (
            old.get("lastTransitionTime", stamp)
            if old is not None and old.get("status") == status
            else stamp
        )
        by_type[update.type] = {
            "type": update.type,
            "status": status,
            "reason": update.reason,
            "message": update.message,
            "lastTransitionTime": transition,
            "observedGeneration": generation,
        }
    return [by_type[key] for key in sorted(by_type, key=str)]


def condition_status(conditions: list[dict[str, Any]] | None, type_: str) -> str | None:
    for condition in conditions or []:
        if condition.get("type") == type_:
            return str(condition.get("status"))
    return None

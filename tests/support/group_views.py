"""Group views from a ``KVCacheGroup`` status, through the agent's one parser."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from node_agent.kube.groups import parse_group
from node_agent.pp.group import GroupViewSource
from node_agent.vocab.group_view import GroupView


def view_of(group: str, status: Mapping[str, Any], replica: str = "") -> GroupView:
    """The view of group ``group`` whose ``KVCacheGroup.status`` is ``status``,
    parsed by :func:`node_agent.kube.groups.parse_group` (``spec.ppSize`` is the
    number of members). Raises ``GroupViewError`` for a malformed status."""
    members = status.get("members") if isinstance(status, Mapping) else None
    size = len(members) if isinstance(members, list) and members else 1
    obj = {"metadata": {"name": group}, "spec": {"replica": replica or group, "ppSize": size},
           "status": status}
    view = parse_group(obj)
    if view is None:
        raise ValueError(f"status {status!r} of group {group!r} has no epoch; add one")
    return view


def update_status(source: GroupViewSource, status: Mapping[str, Any]) -> bool:
    """Feed ``source`` the view its group has under ``status`` (as the agent does);
    False when nothing changed."""
    return source.update(view_of(source.view.group, status))

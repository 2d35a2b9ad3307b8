"""A PP group as the operator decided it: name, epoch, leader and members.

The one model of a group view. The shape is ``KVCacheGroup`` of
docs/contracts.md section 3; :func:`node_agent.kube.groups.parse_group` is its one
parser. The agent keeps the views of its pool's groups (``/status`` shows them
through :meth:`GroupView.to_json`) and hands each multi-stage stage the view of
its group, which the stage's :class:`~node_agent.pp.group.GroupViewSource` accepts
only when its epoch does not go back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class GroupViewError(ValueError):
    """A group view is malformed or not acceptable (the message names the field)."""


@dataclass(frozen=True)
class GroupMember:
    """One stage of a PP group: its node, PP rank and fan-out endpoint; ``ready`` is
    False while the operator sees the stage's agent as lost."""

    node: str
    pp_rank: int
    fanout_endpoint: str
    ready: bool = True


@dataclass(frozen=True)
class GroupView:
    """One consistent view of a PP group.

    ``group`` is the ``KVCacheGroup`` name (the fan-out group); ``leader`` is None
    while the operator has no fresh member to elect (no decisions can be made
    then). ``replica`` and ``pp_size`` are the object's ``spec.replica`` and
    ``spec.ppSize`` (``""`` and 0 for a view built in process, before any
    ``KVCacheGroup`` is known)."""

    group: str
    epoch: int
    leader: GroupMember | None
    members: tuple[GroupMember, ...]
    replica: str = ""
    pp_size: int = 0

    def member(self, pp_rank: int) -> GroupMember | None:
        """The member holding ``pp_rank``, if any."""
        return next((m for m in self.members if m.pp_rank == pp_rank), None)

    def followers(self) -> tuple[GroupMember, ...]:
        """Every member but the leader, by pp rank."""
        lead = None if self.leader is None else self.leader.pp_rank
        return tuple(sorted((m for m in self.members if m.pp_rank != lead),
                            key=lambda m: m.pp_rank))

    @property
    def size(self) -> int:
        """Number of stages listed as members."""
        return len(self.members)

    def to_json(self) -> dict[str, Any]:
        """The view as /status shows it."""
        def m(x: GroupMember) -> dict[str, Any]:
            return {"node": x.node, "ppRank": x.pp_rank, "fanoutEndpoint": x.fanout_endpoint,
                    "ready": x.ready}
        return {"name": self.group, "replica": self.replica, "ppSize": self.pp_size,
                "epoch": self.epoch, "leader": m(self.leader) if self.leader else None,
                "members": [m(x) for x in self.members]}

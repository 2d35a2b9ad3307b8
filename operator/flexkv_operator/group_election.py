"""Leader election for one PP group: a pure decision over the published state.

The decision is made from the group's *published* status (epoch and leader as
read from the API, not from memory) and the members' freshness, and is written
back conditional on the resourceVersion it was read at. Two operators deciding
from the same version therefore publish at most one leader for the next epoch;
the loser's write gets 409, it re-reads and decides again.

Rules:
* a published leader that is still a fresh member stays leader (no pre-emption,
  so epochs do not flap when rank 0 comes back);
* otherwise the new leader is the best fresh member: ready before not ready,
  then the lowest pp rank (rank 0 preferred), then the node name;
* no fresh member means no leader;
* every change of leader, including to or from none, bumps the epoch by one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A member of a group as the operator sees it now."""

    node: str
    pp_rank: int
    fanout_endpoint: str
    ready: bool
    fresh: bool


@dataclass(frozen=True)
class Published:
    """The leader and epoch currently published in a KVCacheGroup's status."""

    epoch: int
    leader_node: str | None
    leader_rank: int | None


@dataclass(frozen=True)
class Decision:
    epoch: int
    leader: Candidate | None
    changed: bool
    failover: bool  # the previous leader was lost (not merely absent before)


def decide(published: Published, members: list[Candidate]) -> Decision:
    """Decide the leader and epoch for a group (see the module docstring)."""
    fresh = [m for m in members if m.fresh]
    current = next(
        (
            m
            for m in fresh
            if m.node == published.leader_node and m.pp_rank == published.leader_rank
        ),
        None,
    )
    if current is not None:
        return Decision(published.epoch, current, changed=False, failover=False)
    best = min(fresh, key=lambda m: (not m.ready, m.pp_rank, m.node), default=None)
    had_leader = published.leader_node is not None
    if best is None and not had_leader:
        return Decision(published.epoch, None, changed=False, failover=False)
    return Decision(published.epoch + 1, best, changed=True, failover=had_leader)

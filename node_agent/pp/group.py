"""The PP group view a connector follows: group name, epoch, leader, members.

The shape is ``KVCacheGroup.status`` of docs/contracts.md section 3. A view
comes from one of two sources, both feeding a :class:`GroupViewSource`:

* in-process: the agent service (which watches the ``KVCacheGroup`` object)
  calls :meth:`GroupViewSource.update` with a :class:`GroupView`, or
  :meth:`GroupViewSource.update_from_status` with the object's ``status`` dict;
* a YAML/JSON file of the same shape, re-read when it changes
  (:class:`GroupViewFile`), for agents run without Kubernetes and for tests.

Epochs never decrease: an update with an older epoch, or the same epoch and a
different leader, is refused (``StaleViewError``), so one epoch always has one
leader as seen by this agent.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)


class GroupViewError(ValueError):
    """A group view document is malformed (the message names the field)."""


class StaleViewError(GroupViewError):
    """An update would move the epoch backwards or change the leader within an epoch."""


@dataclass(frozen=True)
class Member:
    """One stage of the group."""

    node: str
    pp_rank: int
    fanout_endpoint: str
    ready: bool = True


@dataclass(frozen=True)
class GroupView:
    """One consistent view of a PP group. ``leader`` is None while the operator
    has no fresh member to elect (no decisions can be made then)."""

    group: str
    epoch: int
    leader: Member | None
    members: tuple[Member, ...]

    def member(self, pp_rank: int) -> Member | None:
        """The member holding ``pp_rank``, if any."""
        return next((m for m in self.members if m.pp_rank == pp_rank), None)

    def followers(self) -> tuple[Member, ...]:
        """Every member but the leader, by pp rank."""
        lead = None if self.leader is None else self.leader.pp_rank
        return tuple(sorted((m for m in self.members if m.pp_rank != lead),
                            key=lambda m: m.pp_rank))

    @property
    def size(self) -> int:
        """Number of stages."""
        return len(self.members)

    @classmethod
    def from_status(cls, group: str, status: Mapping[str, Any]) -> GroupView:
        """Parse ``KVCacheGroup.status`` (camelCase keys, contracts section 3)."""
        if not isinstance(status, Mapping):
            raise GroupViewError(f"Group {group!r}: status must be a mapping, got {status!r}")
        epoch = status.get("epoch", 0)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise GroupViewError(
                f"Group {group!r}: status.epoch must be an int >= 0, got {epoch!r}"
            )
        raw_members = status.get("members") or []
        if not isinstance(raw_members, list):
            raise GroupViewError(f"Group {group!r}: status.members must be a list")
        members = tuple(_member(group, f"members[{i}]", m) for i, m in enumerate(raw_members))
        ranks = [m.pp_rank for m in members]
        if len(set(ranks)) != len(ranks):
            raise GroupViewError(f"Group {group!r}: duplicate ppRank in members {ranks}")
        leader = None
        if status.get("leader"):
            leader = _member(group, "leader", status["leader"])
            if members and leader.pp_rank not in ranks:
                raise GroupViewError(
                    f"Group {group!r}: leader ppRank {leader.pp_rank} is not a member {ranks}"
                )
        return cls(group, epoch, leader, members)


def _member(group: str, where: str, raw: Any) -> Member:
    if not isinstance(raw, Mapping):
        raise GroupViewError(f"Group {group!r}: status.{where} must be a mapping, got {raw!r}")
    node, rank, ep = raw.get("node"), raw.get("ppRank"), raw.get("fanoutEndpoint")
    if not isinstance(node, str) or not node:
        raise GroupViewError(f"Group {group!r}: status.{where}.node must be a non-empty string")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise GroupViewError(
            f"Group {group!r}: status.{where}.ppRank must be an int >= 0, got {rank!r}"
        )
    if not isinstance(ep, str) or not ep.startswith("tcp://"):
        raise GroupViewError(
            f"Group {group!r}: status.{where}.fanoutEndpoint must be tcp://host:port, got {ep!r}"
        )
    return Member(node, rank, ep, bool(raw.get("ready", True)))


Listener = Callable[[GroupView], None]


class GroupViewSource:
    """The current view of one group plus change listeners (thread-safe).

    This is the in-process update API: ``update(view)`` / ``update_from_status``.
    Listeners run synchronously in the updating thread, after the view changed.
    """

    def __init__(self, initial: GroupView) -> None:
        self._lock = threading.Lock()
        self._view = initial
        self._listeners: list[Listener] = []

    @property
    def view(self) -> GroupView:
        """The current view."""
        with self._lock:
            return self._view

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(view)`` after every accepted change."""
        with self._lock:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling ``listener`` (no error when it was not subscribed)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def update(self, view: GroupView) -> bool:
        """Install ``view``; returns False when nothing changed.

        Raises ``StaleViewError`` for another group, an older epoch, or a
        different leader under the same epoch.
        """
        with self._lock:
            cur = self._view
            if view.group != cur.group:
                raise StaleViewError(f"View for group {view.group!r} given to group {cur.group!r}")
            if view.epoch < cur.epoch:
                raise StaleViewError(
                    f"Group {cur.group!r}: epoch {view.epoch} is older than {cur.epoch}"
                )
            if (
                view.epoch == cur.epoch and cur.leader is not None and view.leader is not None
                and view.leader.pp_rank != cur.leader.pp_rank
            ):
                raise StaleViewError(
                    f"Group {cur.group!r}: epoch {view.epoch} already has leader rank "
                    f"{cur.leader.pp_rank}, refusing rank {view.leader.pp_rank}"
                )
            if view == cur:
                return False
            self._view = view
            listeners = list(self._listeners)
        for fn in listeners:
            fn(view)
        return True

    def update_from_status(self, status: Mapping[str, Any]) -> bool:
        """``update`` from a ``KVCacheGroup.status`` mapping."""
        return self.update(GroupView.from_status(self.view.group, status))


def load_view_file(path: str | Path) -> GroupView:
    """Read a view file: YAML or JSON holding either ``{group, status}`` or a
    whole ``KVCacheGroup`` object (``metadata.name`` and ``status``)."""
    text = Path(path).read_text()
    try:
        doc = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise GroupViewError(f"Group view file {path}: not valid YAML/JSON: {exc}") from None
    if not isinstance(doc, Mapping):
        raise GroupViewError(f"Group view file {path}: top level must be a mapping")
    group = doc.get("group") or (doc.get("metadata") or {}).get("name")
    if not isinstance(group, str) or not group:
        raise GroupViewError(f"Group view file {path}: needs 'group' or 'metadata.name'")
    return GroupView.from_status(group, doc.get("status") or {})


class GroupViewFile:
    """Polls a view file and feeds changes into a :class:`GroupViewSource`.

    The file is re-read when its mtime or size changes (checked every
    ``interval`` seconds); an unreadable or stale document is logged and
    ignored, keeping the last good view.
    """

    def __init__(self, path: str | Path, interval: float = 0.2) -> None:
        self.path = Path(path)
        self.source = GroupViewSource(load_view_file(self.path))
        self._interval = interval
        self._stamp = self._stat()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-view-file", daemon=True)

    def _stat(self) -> tuple[int, int]:
        st = self.path.stat()
        return (st.st_mtime_ns, st.st_size)

    def start(self) -> GroupViewFile:
        """Start polling; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (bounded join)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def poll(self) -> bool:
        """Re-read the file if it changed; True when the view changed."""
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            return self.source.update(load_view_file(self.path))
        except (OSError, GroupViewError) as exc:
            log.warning("Ignoring group view file update", extra={"path": str(self.path),
                                                                  "error": str(exc)})
            return False

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.poll()

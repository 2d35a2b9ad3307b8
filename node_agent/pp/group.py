"""The PP group view a coordinator follows, and how it may change.

The view is a :class:`~node_agent.vocab.group_view.GroupView` (group name, epoch,
leader, members). The agent parses each ``KVCacheGroup`` of its pool
(:mod:`node_agent.kube.groups`, from the API or a file) and calls
:meth:`GroupViewSource.update` of every stage of that group.

Epochs never decrease: an update with an older epoch, or the same epoch and a
different leader, is refused (``StaleViewError``), so one epoch always has one
leader as seen by this agent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from node_agent.vocab.group_view import GroupView, GroupViewError


class StaleViewError(GroupViewError):
    """An update would move the epoch backwards or change the leader within an epoch."""


Listener = Callable[[GroupView], None]


class GroupViewSource:
    """The current view of one group plus change listeners (thread-safe).

    This is the in-process update API: ``update(view)``. Listeners run
    synchronously in the updating thread, after the view changed.
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


"""Group views: which PP groups exist, who leads them at which epoch, who the members
are (docs/contracts.md section 3), read from ``KVCacheGroup`` status or from a file.

:func:`parse_group` (the one parser of a KVCacheGroup) turns one KVCacheGroup-shaped
mapping into a :class:`~node_agent.vocab.group_view.GroupView`; objects without a
usable status (no epoch yet) are skipped, malformed ones are reported and skipped.
Two sources deliver the views of this agent's pool to a callback, only when they
changed:

* :class:`~node_agent.kube.group_watch.KubeGroupSource` lists and then watches
  ``kvcachegroups.flexkv.io`` through the ``kubernetes`` client;
* :class:`FileGroupSource` (here) reads a YAML/JSON file holding a list of such
  objects (or ``{"items": [...]}``) whenever its modification time changes.

Both filter on ``spec.poolRef`` themselves (label selectors are an optimisation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from node_agent.contract import kube
from node_agent.vocab.group_view import GroupMember, GroupView, GroupViewError
from node_agent.vocab.recent_errors import RecentErrors

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = kube.CRD_GROUP, kube.CRD_VERSION, kube.GROUP_PLURAL


def _member(obj: object, where: str) -> GroupMember:
    if not isinstance(obj, Mapping):
        raise GroupViewError(f"{where}: {obj!r} is not an object with node, ppRank, "
                             "fanoutEndpoint")
    node, rank, ep = obj.get("node"), obj.get("ppRank"), obj.get("fanoutEndpoint")
    if not isinstance(node, str) or not isinstance(rank, int) or not isinstance(ep, str):
        raise GroupViewError(f"{where}: needs node (string), ppRank (int), fanoutEndpoint "
                             f"(string), got {dict(obj)!r}")
    if not node:
        raise GroupViewError(f"{where}.node must be a non-empty string")
    if isinstance(rank, bool) or rank < 0:
        raise GroupViewError(f"{where}.ppRank must be an int >= 0, got {rank!r}")
    if not ep.startswith("tcp://"):
        raise GroupViewError(f"{where}.fanoutEndpoint must be tcp://host:port, got {ep!r}")
    return GroupMember(node=node, pp_rank=rank, fanout_endpoint=ep,
                       ready=bool(obj.get("ready", True)))


def parse_group(obj: Mapping[str, Any]) -> GroupView | None:
    """Parse one KVCacheGroup; None when it has no status epoch yet."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status")
    name = meta.get("name", "?")
    if not isinstance(status, Mapping) or status.get("epoch") is None:
        return None
    epoch = status.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise GroupViewError(f"KVCacheGroup {name}: status.epoch {epoch!r} must be an int >= 0")
    replica, pp_size = spec.get("replica"), spec.get("ppSize")
    if not isinstance(replica, str) or not isinstance(pp_size, int) or pp_size < 1:
        raise GroupViewError(f"KVCacheGroup {name}: spec needs replica (string) and ppSize "
                             f"(int >= 1), got {replica!r} / {pp_size!r}")
    leader_raw = status.get("leader")
    leader = _member(leader_raw, f"KVCacheGroup {name} status.leader") if leader_raw else None
    raw_members = status.get("members") or []
    if not isinstance(raw_members, list):
        raise GroupViewError(f"KVCacheGroup {name}: status.members must be a list, "
                             f"got {raw_members!r}")
    members = tuple(_member(m, f"KVCacheGroup {name} status.members[{i}]")
                    for i, m in enumerate(raw_members))
    ranks = [m.pp_rank for m in members]
    if len(set(ranks)) != len(ranks):
        raise GroupViewError(f"KVCacheGroup {name}: duplicate ppRank in status.members {ranks}")
    if leader is not None and members and leader.pp_rank not in ranks:
        raise GroupViewError(f"KVCacheGroup {name}: status.leader ppRank {leader.pp_rank} "
                             f"is not a member {ranks}")
    return GroupView(group=name, replica=replica, pp_size=pp_size, epoch=epoch,
                     leader=leader, members=members)


def parse_groups(objs: Sequence[Mapping[str, Any]], pool: str,
                 errors: RecentErrors | None = None) -> dict[str, GroupView]:
    """Views of ``pool``'s groups keyed by replica; malformed objects are reported and
    skipped so that one bad object does not hide the others."""
    out: dict[str, GroupView] = {}
    for obj in objs:
        spec = obj.get("spec") or {}
        if spec.get("poolRef") not in (None, pool):
            continue
        try:
            view = parse_group(obj)
        except GroupViewError as exc:
            log.warning("KVCacheGroup skipped", extra={"error": str(exc)})
            if errors is not None:
                errors.record("group_view", str(exc))
            continue
        if view is not None:
            out[view.replica] = view
    return out


ViewsCallback = Callable[[dict[str, GroupView]], None]


class ViewDelivery:
    """Parses a set of objects and calls ``on_views`` when the views changed."""

    name = "group_view"

    def __init__(self, pool: str, on_views: ViewsCallback,
                 errors: RecentErrors | None, source: str) -> None:
        self._pool = pool
        self._on_views = on_views
        self._errors = errors
        self.source = source
        self.views: dict[str, GroupView] | None = None

    @property
    def known(self) -> bool:
        """True once a view (possibly empty) was read successfully."""
        return self.views is not None

    def deliver(self, objs: Sequence[Mapping[str, Any]]) -> bool:
        """Parse ``objs``; True (and ``on_views`` called) when the views changed."""
        views = parse_groups(objs, self._pool, self._errors)
        if views == self.views:
            return False
        self.views = views
        self._on_views(views)
        log.info("Group views updated", extra={"source": self.source,
                                               "groups": sorted(views)})
        return True

    def report(self, exc: BaseException) -> None:
        """Log and remember a failed read."""
        log.warning("Group view read failed", extra={"source": self.source, "error": str(exc)})
        if self._errors is not None:
            self._errors.record(self.name, f"{self.source}: {exc}")


class FileGroupSource(ViewDelivery):
    """KVCacheGroup-shaped objects from a YAML/JSON file (no Kubernetes), re-read
    every ``period`` seconds when the file's modification time changed."""

    def __init__(self, path: str | os.PathLike[str], pool: str, on_views: ViewsCallback,
                 period: float, errors: RecentErrors | None = None) -> None:
        self.path = Path(path)
        super().__init__(pool, on_views, errors, f"file:{self.path}")
        self._period = period
        self._mtime: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def alive(self) -> bool:
        """True while the polling loop runs."""
        return self._task is not None and not self._task.done()

    def poll_once(self) -> bool:
        """Re-read the file if it changed (blocking); True when the views changed."""
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            raise FileNotFoundError(
                f"group view file {self.path} does not exist; write the KVCacheGroup list "
                "there or unset groupViewFile") from None
        if mtime == self._mtime:
            return False
        data = yaml.safe_load(self.path.read_text()) or []
        if isinstance(data, Mapping):
            data = data.get("items", [])
        if not isinstance(data, list):
            raise GroupViewError(f"group view file {self.path}: expected a list of "
                                 f"KVCacheGroup objects, got {type(data).__name__}")
        self._mtime = mtime
        return self.deliver([d for d in data if isinstance(d, Mapping)])

    async def start(self) -> None:
        """Read once (a failure is reported and retried), then poll."""
        try:
            await asyncio.to_thread(self.poll_once)
        except Exception as exc:
            self.report(exc)
        self._task = asyncio.create_task(self._loop(), name="group-view-file")

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._period)
            if self._stopping.is_set():
                return
            try:
                await asyncio.wait_for(asyncio.to_thread(self.poll_once), self._period * 5)
            except Exception as exc:
                self.report(exc)

    async def stop(self) -> None:
        """Stop polling (bounded)."""
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, self._period * 5)

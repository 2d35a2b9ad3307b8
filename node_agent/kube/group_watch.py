"""Group views from the Kubernetes API: list, then watch ``KVCacheGroup``s of the pool.

A worker thread lists the pool's groups (label ``flexkv.io/pool``), delivers the
views, then watches from the list's ``resourceVersion`` and delivers again on
every event that changes them. A watch that ends (server timeout) resumes from
the last seen version; an expired version (410), a read timeout or any other
error makes it list again, after ``period`` seconds for errors (reported to
/status). Every request is bounded: the watch asks the server to end it after
``watch_seconds`` and reads with a timeout a little longer than that.

The ``kubernetes`` client is synchronous, hence the thread; ``stop`` ends the
watch and joins the thread with a bound (it is a daemon thread, so a connection
that does not close promptly cannot hold the process).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import Any

from kubernetes import watch
from kubernetes.client import CustomObjectsApi
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from node_agent.contract import kube
from node_agent.kube.groups import GROUP, PLURAL, VERSION, ViewDelivery, ViewsCallback
from node_agent.vocab.recent_errors import RecentErrors

log = logging.getLogger(__name__)


class KubeGroupSource(ViewDelivery):
    """KVCacheGroups of ``pool`` in ``namespace``, listed then watched."""

    def __init__(self, api: CustomObjectsApi, namespace: str, pool: str,
                 on_views: ViewsCallback, period: float,
                 errors: RecentErrors | None = None, watch_seconds: int = 60) -> None:
        super().__init__(pool, on_views, errors, f"kubernetes:{namespace}")
        self._api = api
        self._namespace = namespace
        self._period = period
        self._watch_seconds = watch_seconds
        self._objects: dict[str, Mapping[str, Any]] = {}
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None
        self.lists = 0
        self.events = 0

    @property
    def alive(self) -> bool:
        """True while the list/watch thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _selector(self) -> str:
        return f"{kube.LABEL_POOL}={self._pool}"

    def list_once(self) -> str | None:
        """List and deliver (blocking); returns the list's resourceVersion."""
        result = self._api.list_namespaced_custom_object(
            GROUP, VERSION, self._namespace, PLURAL, label_selector=self._selector(),
            _request_timeout=self._period * 4 + 5)
        items = result.get("items", []) if isinstance(result, Mapping) else []
        self._objects = {
            str((i.get("metadata") or {}).get("name")): i for i in items if isinstance(i, Mapping)
        }
        self.lists += 1
        self.deliver(list(self._objects.values()))
        meta = result.get("metadata") if isinstance(result, Mapping) else None
        rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
        return str(rv) if rv else None

    def _watch_from(self, rv: str | None) -> str | None:
        """Watch until the stream ends; returns the last seen resourceVersion."""
        w = watch.Watch()
        self._watch = w
        kwargs: dict[str, Any] = {
            "label_selector": self._selector(), "timeout_seconds": self._watch_seconds,
            "_request_timeout": (self._period * 4 + 5, self._watch_seconds + 10),
        }
        if rv:
            kwargs["resource_version"] = rv
        for event in w.stream(self._api.list_namespaced_custom_object, GROUP, VERSION,
                              self._namespace, PLURAL, **kwargs):
            if self._stop.is_set():
                break
            obj = event.get("raw_object") or event.get("object")
            if not isinstance(obj, Mapping):
                continue
            meta = obj.get("metadata") or {}
            rv = str(meta.get("resourceVersion") or rv or "") or None
            name = str(meta.get("name"))
            kind = event.get("type")
            if kind in ("ADDED", "MODIFIED"):
                self._objects[name] = obj
            elif kind == "DELETED":
                self._objects.pop(name, None)
            else:
                continue  # BOOKMARK and anything newer
            self.events += 1
            self.deliver(list(self._objects.values()))
        return rv

    def _run(self) -> None:
        rv: str | None = None
        need_list = self.views is None
        while not self._stop.is_set():
            try:
                if need_list:
                    rv = self.list_once()
                    need_list = False
                rv = self._watch_from(rv)
            except ApiException as exc:
                need_list = True
                if exc.status != 410:  # 410: our version expired; list again at once
                    self.report(exc)
                    self._stop.wait(self._period)
            except Urllib3Error as exc:
                # Read timeouts and dropped connections end a watch; list again.
                log.debug("Group watch ended", extra={"error": str(exc)})
                need_list = True
                self._stop.wait(min(self._period, 1.0))
            except Exception as exc:
                need_list = True
                self.report(exc)
                self._stop.wait(self._period)

    async def start(self) -> None:
        """List once (a failure is reported; the thread retries), then watch."""
        try:
            await asyncio.to_thread(self.list_once)
        except Exception as exc:
            self.report(exc)
        self._thread = threading.Thread(target=self._run, name="group-view-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """End the watch; join the thread within ``period`` seconds."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self._period + 1.0)

"""An emulated Kubernetes API server for the tests and benchmarks (kmock-based).

One emulator serves every suite that talks to Kubernetes: the operator's tests
and benchmark (kopf and the operator's own client) and the agent's tests of its
Lease heartbeat and KVCacheGroup watch (the ``kubernetes`` client). It uses
kmock's public API only: :class:`kmock.KubernetesEmulator` is subclassed the way
its documentation invites ("inherit and implement for your cases") by
overriding its request handler.

kmock's emulator stores objects and streams watch events but has no
resourceVersion, uid, generation, optimistic concurrency or status subresource
semantics. :class:`ApiServer` adds exactly those, as the real API server
behaves, plus fault injection:

* create: ``metadata.uid``, ``creationTimestamp``, ``generation: 1`` and a fresh
  ``resourceVersion``; ``status`` is dropped for resources with a status
  subresource (flexkv.io kinds, as the chart's CRDs declare);
* patch: a ``metadata.resourceVersion`` in the body is a precondition (409
  ``Conflict`` when stale); so is ``preconditions.resourceVersion`` in the
  DeleteOptions body of a delete; every accepted patch gets a new resourceVersion; a
  patch of ``/status`` changes only ``status``; a patch of the main resource
  ignores ``status`` for flexkv.io kinds and bumps ``generation`` when ``spec``
  changes;
* delete: objects whose ``metadata.ownerReferences`` name the deleted object's
  uid are deleted too, in the background and recursively (the garbage
  collector's background propagation), unless another owner remains; an object
  created later whose owners are all deleted already is collected the same way
  (a client that read its owner just before the deletion);
* :meth:`ApiServer.fail` makes the next N matching requests answer an error
  status before touching any state (optionally only requests whose
  ``User-Agent`` starts with a prefix: an outage seen by one client, e.g. the
  operator's own requests);
* ``history_limit`` (None by default: keep all, for assertions) bounds kmock's
  request log, for long runs (the benchmark).

kmock routes every request through its DSL, which matches the request against
its whole request log (quadratic in the requests served). :class:`DirectRouting`
answers the plain Kubernetes actions (list, fetch, create, update, delete) with
kmock's own emulator handlers directly, after the same state changes; watches and
anything else still go through the DSL. Behaviour is the same, the cost per
request no longer grows with the run. A consequence: a DSL reaction
(``api[...] << 500``) applies to watches and non-resource paths only; inject a
fault into the plain actions with :meth:`ApiServer.fail`.

The request log is read through kmock's public views: ``list(api)`` for every
request, ``api[kmock.action.WATCH]`` for the watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import uuid
import warnings
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import kmock
from kmock import KubernetesError, KubernetesScaffold

STATUS_SUBRESOURCE_GROUPS = frozenset({"flexkv.io"})
NS = "ns1"
"""The namespace the tests' objects live in unless they name another."""
POOLS = "flexkv.io/v1alpha1/kvcachepools"
GROUPS = "flexkv.io/v1alpha1/kvcachegroups"
LEASES = "coordination.k8s.io/v1/leases"
DAEMONSETS = "apps/v1/daemonsets"


def merge_patch(value: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(value) if isinstance(value, dict) else {}
    for key, item in patch.items():
        if item is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), item)
    return result


@dataclass
class Fault:
    action: str | None
    plural: str | None
    status: int
    remaining: int
    hits: int = 0
    user_agent: str | None = None
    lost_reply: bool = False  # apply the request, then answer ``status`` (a lost reply)


def collection_path(plural_path: str, namespace: str | None) -> str:
    """The URL path of a collection: ``apps/v1/daemonsets`` in ``ns1`` is
    ``/apis/apps/v1/namespaces/ns1/daemonsets``; ``v1/pods`` is under ``/api``."""
    group_version, plural = plural_path.rsplit("/", 1)
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{scope}/{plural}"


class DirectRouting(KubernetesScaffold):
    """Placed after KubernetesEmulator in the MRO: its ``super()._handle`` lands here."""

    __slots__ = ()

    async def _handle(self, request: kmock.Request) -> Any:
        emulator: Any = self
        direct = {
            kmock.action.LIST: emulator._serve_list,
            kmock.action.FETCH: emulator._serve_fetch,
            kmock.action.CREATE: emulator._serve_create,
            kmock.action.UPDATE: emulator._serve_update,
            kmock.action.DELETE: emulator._serve_delete,
        }
        resource = request.resource
        named = request.name is not None or request.action in (
            kmock.action.LIST,
            kmock.action.CREATE,
        )
        if resource is not None and resource.plural and request.action in direct and named:
            return aiohttp.web.json_response(await direct[request.action](request))
        return await super()._handle(request)


class ApiServer(kmock.KubernetesEmulator, DirectRouting):
    """kmock's emulator with resourceVersion, generation, preconditions and faults."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings():  # kmock reads its bundle with a deprecated API
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()
        for plural, kind in (("kvcachepools", "KVCachePool"), ("kvcachegroups", "KVCacheGroup")):
            self.resources[f"flexkv.io/v1alpha1/{plural}"] = kmock.ResourceInfo(
                kind=kind,
                namespaced=True,
                verbs={"get", "list", "watch", "create", "patch", "delete"},
                subresources={"status"},
            )
        self._versions = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self.faults: list[Fault] = []
        self.conflicts = 0
        self.history_limit: int | None = None
        self._collectors: set[asyncio.Task[None]] = set()
        self.collected: list[tuple[str, str, str]] = []
        self.deleted_uids: set[str] = set()

    def fail(
        self,
        status: int,
        *,
        action: str | None = None,
        plural: str | None = None,
        times: int = 1,
        user_agent: str | None = None,
        lost_reply: bool = False,
    ) -> Fault:
        """Answer ``status`` to the next ``times`` requests of ``action`` (list, watch,
        fetch, create, update, delete; None for any) on ``plural`` (None for any), from
        clients whose User-Agent starts with ``user_agent`` (None for any). With
        ``lost_reply`` the request takes effect first and only its answer is the error
        (a reply lost on the way back). Setting ``remaining`` to 0 ends the fault."""
        fault = Fault(action, plural, status, times, user_agent=user_agent, lost_reply=lost_reply)
        self.faults.append(fault)
        return fault

    def stored(self, plural_path: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The stored object or None (``plural_path`` like ``apps/v1/daemonsets``)."""
        key = (kmock.resource(plural_path), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        raw: dict[str, Any] = copy.deepcopy(self.objects[key].raw)
        return raw

    def stored_key(self, key: Any) -> dict[str, Any] | None:
        if key not in self.objects or self.objects[key].deleted:
            return None
        raw: dict[str, Any] = copy.deepcopy(self.objects[key].raw)
        return raw

    async def _collect_dependents(self, owner_uid: str) -> None:
        """Delete every live object owned by ``owner_uid`` and no other live owner."""
        live_uids = {
            (obj.raw.get("metadata") or {}).get("uid")
            for obj in self.objects.values()
            if not obj.deleted
        }
        for (resource, namespace, name), obj in list(self.objects.items()):
            if obj.deleted:
                continue
            owners = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
            uids = {o.get("uid") for o in owners if isinstance(o, dict)}
            if owner_uid not in uids or uids & live_uids:
                continue
            parts = (resource.group, resource.version, resource.plural)
            path = collection_path("/".join(str(p) for p in parts if p), namespace)
            response = await self.delete(f"{path}/{name}")
            self.collected.append((str(resource.plural), str(namespace), str(name)))
            assert response.status < 300 or response.status == 404, await response.text()

    def names(self, plural_path: str, namespace: str | None = None) -> list[str]:
        result = []
        for (resource, ns, name), obj in self.objects.items():
            wanted = kmock.resource(plural_path) == resource and not obj.deleted
            if wanted and (namespace is None or ns == namespace):
                result.append(name)
        return sorted(result)

    def requests_from(
        self,
        user_agent: str,
        *,
        methods: Collection[str] = (),
        plural: str | None = None,
        name: str | None = None,
    ) -> list[kmock.Request]:
        """The requests served so far, refused ones included, whose User-Agent starts
        with ``user_agent``; only those with one of ``methods`` (``GET``, ``POST``,
        ``PATCH``, ``PUT``, ``DELETE``; any when empty), on ``plural`` and on the
        object ``name`` when given."""
        found = []
        for request in list(self):
            if not str(request.headers.get("User-Agent", "")).startswith(user_agent):
                continue
            method = str(getattr(request.method, "value", request.method)).upper()
            if methods and method not in methods:
                continue
            resource = request.resource
            if plural is not None and (resource is None or resource.plural != plural):
                continue
            if name is not None and request.name != name:
                continue
            found.append(request)
        return found

    async def create_object(
        self, plural_path: str, body: dict[str, Any], namespace: str = NS
    ) -> dict[str, Any]:
        """POST ``body`` into ``namespace`` over HTTP, as a client would; return the
        stored object (``plural_path`` like ``apps/v1/daemonsets``). Fails the test
        on an error status."""
        response = await self.post(collection_path(plural_path, namespace), json=body)
        assert response.status < 300, await response.text()
        result: dict[str, Any] = await response.json()
        return result

    async def patch_object(
        self, plural_path: str, name: str, body: dict[str, Any], namespace: str = NS
    ) -> dict[str, Any]:
        """Merge-patch the named object over HTTP; return it. Fails the test on an
        error status."""
        response = await self.patch(f"{collection_path(plural_path, namespace)}/{name}", json=body)
        assert response.status < 300, await response.text()
        result: dict[str, Any] = await response.json()
        return result

    async def delete_object(self, plural_path: str, name: str, namespace: str = NS) -> None:
        """DELETE the named object over HTTP. Fails the test on an error status."""
        response = await self.delete(f"{collection_path(plural_path, namespace)}/{name}")
        assert response.status < 300, await response.text()

    def _check_faults(self, request: kmock.Request, lost_reply: bool = False) -> None:
        action = str(request.action.value).lower() if request.action is not None else None
        plural = request.resource.plural if request.resource is not None else None
        for fault in self.faults:
            if fault.remaining <= 0:
                continue
            if fault.action not in (None, action) or fault.plural not in (None, plural):
                continue
            if fault.lost_reply != lost_reply:
                continue
            if fault.user_agent is not None and not str(
                request.headers.get("User-Agent", "")
            ).startswith(fault.user_agent):
                continue
            fault.remaining -= 1
            fault.hits += 1
            raise KubernetesError(
                status=fault.status, reason="InjectedFault", message=f"injected {fault.status}"
            )

    def _stamp_create(self, request: kmock.Request) -> None:
        data = request.data
        meta = data.setdefault("metadata", {})
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        meta["creationTimestamp"] = datetime.datetime.now(datetime.UTC).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        if request.resource is not None and request.resource.group in STATUS_SUBRESOURCE_GROUPS:
            data.pop("status", None)

    def _stamp_update(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # kmock answers 404
        current = self.objects[key].raw
        data = request.data
        meta = data.setdefault("metadata", {}) if isinstance(data, dict) else {}
        wanted = meta.get("resourceVersion")
        have = current.get("metadata", {}).get("resourceVersion")
        if wanted is not None and wanted != have:
            self.conflicts += 1
            raise KubernetesError(
                status=409,
                reason="Conflict",
                message=f"the object has been modified: resourceVersion {wanted} != {have}",
            )
        group = request.resource.group if request.resource is not None else ""
        if request.subresource == "status":
            for field in list(data):
                if field not in ("metadata", "status"):
                    data.pop(field)
            data["metadata"] = {}
        elif group in STATUS_SUBRESOURCE_GROUPS:
            data.pop("status", None)
        if "spec" in data and merge_patch(current.get("spec"), data["spec"]) != current.get("spec"):
            data["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
        data["metadata"]["resourceVersion"] = str(next(self._versions))

    def _check_delete_precondition(self, request: kmock.Request) -> None:
        wanted = (request.data.get("preconditions") or {}).get("resourceVersion")
        key = (request.resource, request.namespace, request.name)
        if wanted is None or key not in self.objects or self.objects[key].deleted:
            return
        have = self.objects[key].raw.get("metadata", {}).get("resourceVersion")
        if wanted != have:
            self.conflicts += 1
            raise KubernetesError(
                status=409,
                reason="Conflict",
                message=f"Precondition failed: resourceVersion {wanted} != {have}",
            )

    def _trim_history(self) -> None:
        limit = self.history_limit
        if limit is not None and len(self._requests) > 2 * limit:
            del self._requests[: len(self._requests) - limit]

    async def _handle(self, request: kmock.Request) -> Any:
        self._trim_history()
        if request.resource is None:
            return await super()._handle(request)
        self._check_faults(request)
        answer = await self._apply(request)
        self._check_faults(request, lost_reply=True)
        return answer

    async def _apply(self, request: kmock.Request) -> Any:
        action = request.action
        if action == kmock.action.DELETE:
            async with self._write_lock:
                if isinstance(request.data, dict):
                    self._check_delete_precondition(request)
                gone = self.stored_key((request.resource, request.namespace, request.name))
                answer = await super()._handle(request)
            uid = ((gone or {}).get("metadata") or {}).get("uid")
            if uid:
                self.deleted_uids.add(str(uid))
                self._schedule_collection(str(uid))
            return answer
        if action in (kmock.action.CREATE, kmock.action.UPDATE) and isinstance(request.data, dict):
            async with self._write_lock:
                if action == kmock.action.CREATE:
                    self._stamp_create(request)
                else:
                    self._stamp_update(request)
                answer = await super()._handle(request)
            if action == kmock.action.CREATE:
                owners = (request.data.get("metadata") or {}).get("ownerReferences") or []
                uids = {str(o.get("uid")) for o in owners if isinstance(o, dict)}
                if uids and uids <= self.deleted_uids:  # created for owners already gone
                    self._schedule_collection(next(iter(uids)))
            return answer
        return await super()._handle(request)

    def _schedule_collection(self, owner_uid: str) -> None:
        task = asyncio.create_task(self._collect_dependents(owner_uid))
        self._collectors.add(task)
        task.add_done_callback(self._collectors.discard)


@contextlib.asynccontextmanager
async def api_server(history_limit: int | None = None) -> AsyncIterator[ApiServer]:
    """A running :class:`ApiServer` on a free local port (``server.url``)."""
    async with ApiServer() as server, kmock.Server(server):
        server.history_limit = history_limit
        yield server

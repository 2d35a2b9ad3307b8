"""Fixtures of the agent tests: an emulated Kubernetes API (kmock) that keeps
``resourceVersion`` / ``uid`` and honours resourceVersion preconditions, and a
``kubernetes`` client pointed at it."""

from __future__ import annotations

import itertools
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import attrs
import kmock
import pytest
import pytest_asyncio
from kmock._internal import enums, rendering  # the emulator's own request types
from kmock._internal.k8s import KubernetesError
from kubernetes import client as k8s


@attrs.frozen
class ConflictError(KubernetesError):
    """409 for a write whose resourceVersion precondition does not hold."""

    status: int = 409
    reason: str = "Conflict"
    message: str = "the object has been modified; please apply your changes to the latest version"


@attrs.define(kw_only=True)
class VersionedEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus what real API servers do and kmock does not: every write
    bumps ``metadata.resourceVersion`` (create also sets ``uid``), and a PATCH that
    carries a ``metadata.resourceVersion`` is refused with 409 unless it matches."""

    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

    async def _handle(self, request: rendering.Request) -> Any:
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                meta["resourceVersion"] = str(next(self._versions))
                meta.setdefault("uid", str(uuid.uuid4()))
            elif request.action == enums.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    current = self.objects[key].get("metadata", {}).get("resourceVersion")
                    wanted = meta.get("resourceVersion")
                    if wanted is not None and wanted != current:
                        raise ConflictError()
                meta["resourceVersion"] = str(next(self._versions))
        return await super()._handle(request)


@pytest_asyncio.fixture()
async def kube() -> AsyncIterator[VersionedEmulator]:
    """A running emulated API server with the bundled resources and KVCacheGroups."""
    async with VersionedEmulator() as emu, kmock.Server(emu):
        with warnings.catch_warnings():  # kmock reads its bundle with a deprecated API
            warnings.simplefilter("ignore", DeprecationWarning)
            emu.resources.load_bundled()
        emu.resources["flexkv.io/v1alpha1/kvcachegroups"] = kmock.ResourceInfo(
            kind="KVCacheGroup", namespaced=True, verbs={"get", "list", "watch", "patch"},
        )
        yield emu


@pytest.fixture()
def kube_api(kube: VersionedEmulator) -> Iterator[k8s.ApiClient]:
    """A ``kubernetes`` API client talking to the emulator."""
    conf = k8s.Configuration()
    conf.host = str(kube.url).rstrip("/")
    api = k8s.ApiClient(conf)
    try:
        yield api
    finally:
        api.close()

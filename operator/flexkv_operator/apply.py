"""Make live children match their renderings (create or merge-patch), idempotently.

A child is current when its ``flexkv.io/spec-hash`` annotation equals the hash of
the new rendering and no field the operator renders was changed on the live
object (drift: a hand edit of the image, of agent.yaml, ...). Drift is judged by
containment: every map key of the rendering must hold the rendered value on the
live object (a null or empty rendered value may be absent), lists item by item.
Keys the live object has beyond the rendering (server defaults, fields other
controllers or webhooks own, list items they append) are not the operator's and
are never compared; quantities are compared by value (the API server writes
``1Gi`` for ``1024Mi``). A drifted child is patched back to its rendering; a
steady-state reconcile makes no write.

A JSON merge patch only sets what it names, so a map key dropped from the
rendering (a nodeSelector entry, the scrape annotations, a service label) would
stay on the live object. Every create and patch therefore records the rendering
in the ``flexkv.io/last-applied`` annotation (as ``kubectl apply`` does), and the
next patch sends ``null`` for every map key that rendering had and the new one
lacks. Lists are replaced whole by a merge patch, so they need nothing. A child
without the annotation (written by an older operator) gets no removals once, and
the annotation from then on.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import logging
from dataclasses import dataclass
from typing import Any

from flexkv_operator import keys, names
from flexkv_operator.children import ANNOTATION_SPEC_HASH, PoolIdentity, render_curve_secret
from flexkv_operator.kube import Conflict, KubeClient, api_path
from flexkv_operator.quantity import parse_quantity

logger = logging.getLogger(__name__)

ANNOTATION_LAST_APPLIED = "flexkv.io/last-applied"

_PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "DaemonSet": "daemonsets",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
}


@dataclass(frozen=True)
class ApplyResult:
    kind: str
    name: str
    action: str  # created | updated | corrected (drift reverted) | unchanged | deleted
    live: dict[str, Any]
    drift: tuple[str, ...] = ()  # the drifted fields, for "corrected"


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have and type(want) is type(have):
        return True
    if isinstance(want, bool) or isinstance(have, bool):
        return False
    if isinstance(want, str | int) and isinstance(have, str | int):
        a, b = parse_quantity(str(want)), parse_quantity(str(have))
        return a is not None and a == b
    return False


def drifted_fields(want: Any, have: Any, path: str = "") -> list[str]:
    """Paths where the live value ``have`` does not contain the rendered ``want``."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return [path or "."]
        found: list[str] = []
        for key, value in want.items():
            # The API server drops null and omits empty values: absent is the same.
            if value in (None, {}, [], "") and have.get(key) in (None, {}, [], ""):
                continue
            if key not in have:
                found.append(f"{path}.{key}")
            else:
                found.extend(drifted_fields(value, have[key], f"{path}.{key}"))
        return found
    if isinstance(want, list):
        if not isinstance(have, list) or len(have) < len(want):
            return [path]
        found = []
        for index, item in enumerate(want):
            found.extend(drifted_fields(item, have[index], f"{path}[{index}]"))
        return found
    return [] if _same_scalar(want, have) else [path]


def object_path(manifest: dict[str, Any], with_name: bool = True) -> str:
    meta = manifest["metadata"]
    return api_path(
        manifest["apiVersion"],
        _PLURALS[manifest["kind"]],
        meta["namespace"],
        meta["name"] if with_name else None,
    )


def removal_patch(last: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` as a merge patch over an object last written from ``last``: every map
    key of ``last`` missing from ``new`` (at any depth of nested maps) becomes None."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = last.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            patch[key] = removal_patch(before, value)
        else:
            patch[key] = value
    for key in last:
        if key not in new:
            patch[key] = None
    return patch


def _last_applied(live: dict[str, Any]) -> dict[str, Any] | None:
    text = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_LAST_APPLIED)
    if not isinstance(text, str):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        logger.warning(
            "Ignoring unreadable last-applied annotation",
            extra={"kind": live.get("kind"), "child": (live.get("metadata") or {}).get("name")},
        )
        return None
    return value if isinstance(value, dict) else None


def _with_last_applied(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` recording its rendering (without apiVersion and kind)
    in the last-applied annotation."""
    rendering = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind")}
    stamped = copy.deepcopy(manifest)
    stamped["metadata"].setdefault("annotations", {})[ANNOTATION_LAST_APPLIED] = json.dumps(
        rendering, sort_keys=True, separators=(",", ":")
    )
    return stamped


async def apply_child(client: KubeClient, manifest: dict[str, Any]) -> ApplyResult:
    """Create the child, or merge-patch it when its spec hash differs, removing the
    map keys the previous rendering had and this one lacks (module docstring)."""
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    manifest = _with_last_applied(manifest)
    live = await client.get_or_none(object_path(manifest))
    if live is None:
        try:
            created = await client.create(object_path(manifest, with_name=False), manifest)
            return ApplyResult(kind, name, "created", created)
        except Conflict:
            # Created concurrently (another operator, or our earlier retried POST).
            live = await client.get(object_path(manifest))
    wanted = manifest["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    have = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
    new = {key: value for key, value in manifest.items() if key not in ("apiVersion", "kind")}
    drift: list[str] = []
    if have == wanted:
        drift = drifted_fields(new, live)
        if not drift:
            return ApplyResult(kind, name, "unchanged", live)
        logger.warning(
            "Child drifted from its rendering; reverting",
            extra={"kind": kind, "child": name, "fields": drift[:10]},
        )
    last = _last_applied(live)
    patch = removal_patch(last, new) if last is not None else new
    patched = await client.patch(object_path(manifest), patch)
    return ApplyResult(kind, name, "corrected" if drift else "updated", patched, tuple(drift))


async def remove_child(
    client: KubeClient, pool: PoolIdentity, api_version: str, kind: str, name: str
) -> ApplyResult | None:
    """Delete a child the pool no longer asks for (a managed master after ``managed``
    or the remote tier was turned off). Only an object this pool owns (an owner
    reference to its uid) is deleted, conditional on the version read, so a namesake
    created by someone else is left alone; None when there is nothing to delete."""
    manifest = {"apiVersion": api_version, "kind": kind,
                "metadata": {"name": name, "namespace": pool.namespace}}
    live = await client.get_or_none(object_path(manifest))
    if live is None:
        return None
    meta = live.get("metadata") or {}
    owners = [o for o in meta.get("ownerReferences") or [] if isinstance(o, dict)]
    if not any(o.get("uid") == pool.owner.get("uid") for o in owners):
        logger.warning(
            "Leaving a namesake of a removed child alone: the pool does not own it",
            extra={"kind": kind, "child": name, "namespace": pool.namespace},
        )
        return None
    try:
        await client.delete(object_path(manifest), resource_version=meta.get("resourceVersion"))
    except Conflict:
        return None  # changed meanwhile: the next reconcile looks again
    return ApplyResult(kind, name, "deleted", live)


def _valid_curve_secret(live: dict[str, Any]) -> bool:
    data = live.get("data") or {}
    try:
        public = base64.b64decode(data.get(names.CURVE_PUBLIC_KEY, ""), validate=True).decode()
        secret = base64.b64decode(data.get(names.CURVE_SECRET_KEY, ""), validate=True).decode()
        return len(public) == 40 and keys.public_from_secret(secret) == public
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return False


async def ensure_curve_secret(client: KubeClient, pool: PoolIdentity) -> ApplyResult:
    """Create ``<pool>-curve`` once; an existing valid key pair is never replaced.

    A Secret whose keys are missing or do not form a pair is rewritten with a
    fresh pair (agents restart their fan-out with it)."""
    public, secret = keys.curve_keypair()
    manifest = render_curve_secret(pool, public, secret)
    live = await client.get_or_none(object_path(manifest))
    if live is None:
        try:
            created = await client.create(object_path(manifest, with_name=False), manifest)
            return ApplyResult("Secret", manifest["metadata"]["name"], "created", created)
        except Conflict:
            live = await client.get(object_path(manifest))
    if _valid_curve_secret(live):
        return ApplyResult("Secret", manifest["metadata"]["name"], "unchanged", live)
    logger.warning(
        "Replacing invalid CurveZMQ secret",
        extra={"secret": manifest["metadata"]["name"], "namespace": pool.namespace},
    )
    patched = await client.patch(object_path(manifest), {"data": manifest["data"]})
    return ApplyResult("Secret", manifest["metadata"]["name"], "updated", patched)

"""The chart's operator RBAC covers every resource the operator's kopf handlers
watch, read from the operator's own handler registry (not a copy of its list)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart.render import NAMESPACE, RELEASE, Render

FULLNAME = f"{RELEASE}-flexkv-operator"


def _granted(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def _kopf_selectors() -> dict[str, list[Any]]:
    """Selectors of the operator's registered kopf handlers, by handler family."""
    kopf = pytest.importorskip("kopf", reason="kopf (operator extra) not installed")
    handlers = pytest.importorskip("flexkv_operator.handlers", reason="operator not importable")
    registry = handlers.register(kopf.OperatorRegistry())
    families = {}
    for family in ("_watching", "_changing", "_spawning", "_indexing"):
        sub = getattr(registry, family, None)
        assert sub is not None, f"kopf's OperatorRegistry has no {family}; update this check"
        families[family] = [h.selector for h in sub.get_all_handlers()]
    return families


def test_every_watched_resource_is_listable_and_watchable(default_render: Render) -> None:
    role = default_render.one("Role", f"{FULLNAME}-operator", NAMESPACE)
    granted = _granted(role["rules"])
    families = _kopf_selectors()
    selectors = [s for family in families.values() for s in family]
    assert selectors, "the operator registers no kopf handler"
    for selector in selectors:
        resource = selector.plural or selector.any_name
        key = (selector.group or "", resource)
        assert {"list", "watch"} <= granted.get(key, set()), (
            f"kopf watches {key} but the operator Role grants {sorted(granted.get(key, []))}"
        )


def test_kopf_never_needs_to_patch_watched_objects() -> None:
    """Only event handlers: kopf stores no progress and adds no finalizer, which is
    why the Role grants pools list/watch and no patch on the main resource."""
    families = _kopf_selectors()
    assert families["_changing"] == [] and families["_spawning"] == [], (
        "the operator registered change/daemon handlers: kopf then patches the watched "
        "objects (progress, finalizers); grant 'patch' on them in the chart's operator Role"
    )

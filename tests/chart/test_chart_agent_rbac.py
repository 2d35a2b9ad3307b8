"""The chart's agent Role grants exactly the Kubernetes API calls the node agent makes.

The calls are read from the agent's source (every ``<verb>_namespaced_<kind>``
method called on a ``kubernetes`` API object, and every such list method handed to
``watch.Watch().stream``), so a new call without a matching rule, or a rule no
code uses any more, fails here with the verb and resource to add or remove.
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.chart.render import NAMESPACE, RELEASE, REPO, Render

FULLNAME = f"{RELEASE}-flexkv-operator"
AGENT_SOURCE = REPO / "node_agent"

_METHOD = re.compile(r"^(create|read|get|list|patch|replace|delete)_namespaced_(\w+)$")
# Any request method of the kubernetes client (the rest, e.g. close(), send nothing).
_REQUEST = re.compile(r"^(create|read|get|list|patch|replace|delete|connect|watch)_\w+$")
# Python client method prefix -> RBAC verb.
_VERBS = {"create": "create", "read": "get", "get": "get", "list": "list",
          "patch": "patch", "replace": "update", "delete": "delete"}

Use = tuple[str, str, str]  # (apiGroup, resource, verb)


class UnknownApiCall(AssertionError):
    """A call this check cannot map to an RBAC rule; the message names it and the fix."""


def _resource(kind: str, args: list[ast.expr], where: str) -> tuple[str, str]:
    groups = pytest.importorskip("node_agent.kube.groups", reason="agent not importable")
    if kind == "lease":
        return "coordination.k8s.io", "leases"
    if kind == "custom_object":
        # Custom object calls take (group, version, namespace, plural, ...); the agent
        # addresses only KVCacheGroups, through the constants of node_agent.kube.groups.
        names = [a.id if isinstance(a, ast.Name) else None for a in args[:4]]
        if len(names) < 4 or names[0] != "GROUP" or names[3] != "PLURAL":
            raise UnknownApiCall(
                f"{where}: custom object call with arguments {names}; pass GROUP, VERSION, "
                "namespace, PLURAL from node_agent.kube.groups or extend this check"
            )
        return groups.GROUP, groups.PLURAL
    raise UnknownApiCall(
        f"{where}: API kind {kind!r} is not mapped to an RBAC resource; add it to "
        "tests/chart/test_chart_agent_rbac.py and grant it in templates/rbac-agent.yaml"
    )


def _receiver_is_api(node: ast.Attribute) -> bool:
    target = node.value
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return str(name).lower().endswith("api")


def api_uses(source: str, where: str) -> set[Use]:
    """Every (apiGroup, resource, verb) that ``source`` calls through a kubernetes client."""
    tree = ast.parse(source)
    uses: set[Use] = set()
    watched: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "stream"
            and node.args
            and isinstance(node.args[0], ast.Attribute)
        ):
            method = _METHOD.match(node.args[0].attr)
            if method is None or method.group(1) != "list":
                raise UnknownApiCall(
                    f"{where}:{node.lineno}: watch stream over {node.args[0].attr!r}; "
                    "streams must watch a list_namespaced_* method"
                )
            group, resource = _resource(method.group(2), node.args[1:], f"{where}:{node.lineno}")
            uses.add((group, resource, "watch"))
            watched.add(id(node.args[0]))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        if id(func) in watched or not _receiver_is_api(func) or not _REQUEST.match(func.attr):
            continue
        method = _METHOD.match(func.attr)
        if method is None:
            raise UnknownApiCall(
                f"{where}:{node.lineno}: {func.attr!r} on a Kubernetes API object is not a "
                "namespaced call this check knows; map it to an RBAC verb here"
            )
        group, resource = _resource(method.group(2), node.args, f"{where}:{node.lineno}")
        uses.add((group, resource, _VERBS[method.group(1)]))
    return uses


def agent_api_uses() -> set[Use]:
    uses: set[Use] = set()
    for path in sorted(AGENT_SOURCE.rglob("*.py")):
        uses |= api_uses(path.read_text(), str(path.relative_to(REPO)))
    return uses


def _granted(render: Render) -> set[Use]:
    role = render.one("Role", f"{FULLNAME}-agent", NAMESPACE)
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_agent_role_grants_exactly_the_calls_the_agent_makes(default_render: Render) -> None:
    used = agent_api_uses()
    granted = _granted(default_render)
    assert sorted(used - granted) == [], "calls the agent makes without a rule"
    assert sorted(granted - used) == [], "verbs granted to the agent that no code uses"


def test_the_agent_uses_leases_and_group_watches() -> None:
    """The scan finds the agent's real calls (an empty scan would pass the check above
    only if the chart granted nothing)."""
    assert agent_api_uses() == {
        ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", "leases", "get"),
        ("coordination.k8s.io", "leases", "patch"),
        ("flexkv.io", "kvcachegroups", "list"),
        ("flexkv.io", "kvcachegroups", "watch"),
    }


def test_scanner_maps_put_to_update_streams_to_watch_and_skips_non_requests() -> None:
    source = (
        "def f(self, w):\n"
        "    self._api.replace_namespaced_lease('n', 'ns', {})\n"
        "    for _ in w.stream(self.api.list_namespaced_lease, 'ns'):\n"
        "        pass\n"
        "    self.api.delete_namespaced_custom_object(GROUP, VERSION, 'ns', PLURAL, 'x')\n"
        "    self._api.api_client.close()\n"
        "    self._api.close()\n"
    )
    assert api_uses(source, "snippet") == {
        ("coordination.k8s.io", "leases", "update"),
        ("coordination.k8s.io", "leases", "watch"),
        ("flexkv.io", "kvcachegroups", "delete"),
    }


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("core_api.create_namespaced_event('ns', {})\n", "'event'"),
        ("self._api.list_node()\n", "'list_node'"),
        ("api.connect_get_namespaced_pod_exec('p', 'ns')\n", "connect_get_namespaced_pod_exec"),
        ("api.get_namespaced_custom_object('g', 'v', 'ns', 'plural', 'x')\n", "custom object"),
        ("w.stream(api.read_namespaced_lease, 'x')\n", "read_namespaced_lease"),
    ],
)
def test_scanner_rejects_calls_it_cannot_map(source: str, named: str) -> None:
    with pytest.raises(UnknownApiCall, match=re.escape(named)):
        api_uses(source, "snippet")


"""The CRDs: structure, defaults, schema and CEL validation of example and bad CRs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import cel_k8s
import jsonschema
import pytest
import yaml
from flexkv_operator import crds
from flexkv_operator.defaults import apply_defaults
from flexkv_operator.host_paths import ssd_path_problem
from flexkv_operator.spec import ConfigInvalid, parse_pool_spec

EXAMPLES = Path(__file__).parent / "examples"
REPO = Path(__file__).resolve().parents[2]


def _validator(plural: str) -> jsonschema.Validator:
    schema = crds.schema(plural)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema, format_checker=jsonschema.FormatChecker())


def cel_violations(
    plural: str, obj: dict[str, Any], old: dict[str, Any] | None = None
) -> list[str]:
    """Evaluate every CEL rule of the CRD on the defaulted object, as the API server
    does (``old``: the stored object, for transition rules on update)."""
    schema = crds.schema(plural)
    defaulted = apply_defaults(obj, schema)
    previous = apply_defaults(old, schema) if old is not None else None
    return cel_k8s.violations(schema, defaulted, previous)


def schema_errors(plural: str, obj: dict[str, Any]) -> list[str]:
    defaulted = apply_defaults(obj, crds.schema(plural))
    return [e.message for e in _validator(plural).iter_errors(defaulted)]


def _pool(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "p"},
        "spec": {"tiers": {"cpu": {"size": "8Gi"}}, **spec},
    }


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    plural = crds.POOL_PLURAL if doc["kind"] == crds.POOL_KIND else crds.GROUP_PLURAL
    assert schema_errors(plural, doc) == []
    assert cel_violations(plural, doc) == []


def test_chart_example_pool_validates_if_present() -> None:
    values = REPO / "charts" / "flexkv-operator" / "values.yaml"
    if not values.exists():
        pytest.skip("chart not present")
    found = yaml.safe_load(values.read_text()).get("examplePool")
    if not isinstance(found, dict) or "spec" not in found:
        pytest.skip("chart has no examplePool.spec value")
    doc = _pool()
    doc["spec"] = found["spec"]
    assert schema_errors(crds.POOL_PLURAL, doc) == []


def test_crd_names_and_printer_columns() -> None:
    pool = crds.load_crd(crds.POOL_PLURAL)
    assert pool["spec"]["names"]["shortNames"] == ["kvp"]
    assert pool["spec"]["scope"] == "Namespaced"
    version = pool["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == ".status.readyAgents"
    assert columns["Groups"] == ".status.groupCount"
    assert columns["Phase"] == ".status.phase"
    assert columns["Age"] == ".metadata.creationTimestamp"
    group = crds.load_crd(crds.GROUP_PLURAL)
    assert group["spec"]["names"]["shortNames"] == ["kvg"]
    assert group["spec"]["versions"][0]["subresources"] == {"status": {}}


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for key, sub in (schema.get("properties") or {}).items():
        found.extend(_walk(sub, f"{path}.{key}"))
    if isinstance(schema.get("items"), dict):
        found.extend(_walk(schema["items"], f"{path}[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        found.extend(_walk(schema["additionalProperties"], f"{path}{{}}"))
    return found


@pytest.mark.parametrize("plural", [crds.POOL_PLURAL, crds.GROUP_PLURAL])
def test_schema_is_structural(plural: str) -> None:
    """Every node has a type (or is int-or-string / preserve-unknown), as apiextensions/v1 needs."""
    untyped = [
        path
        for path, node in _walk(crds.schema(plural))
        if "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert untyped == []


def test_status_declares_every_condition_type() -> None:
    conditions = crds.schema(crds.POOL_PLURAL)["properties"]["status"]["properties"]["conditions"]
    assert set(conditions["items"]["properties"]["type"]["enum"]) == {
        "Ready",
        "Progressing",
        "Degraded",
        "ConfigValid",
        "SizingValid",
    }
    assert set(conditions["items"]["properties"]) >= {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }


def test_defaults_fill_a_minimal_pool() -> None:
    spec = apply_defaults(_pool(), crds.schema(crds.POOL_PLURAL))["spec"]
    assert spec["backend"] == "embedded"
    assert spec["tokensPerBlock"] == 16
    assert spec["tiers"]["cpu"]["pinned"] is True
    assert spec["leaderElection"] == {
        "leaseDurationSeconds": 15,
        "renewDeadlineSeconds": 10,
        "retryPeriodSeconds": 2,
    }
    assert spec["agent"]["ports"] == {"http": 8080, "fanout": 5557}
    assert spec["eviction"] == {"policy": "lru", "highWatermark": 0.95, "lowWatermark": 0.85}


BAD_BY_SCHEMA = [
    ("unknown backend", {"backend": "redis"}),
    ("size negative", {"tiers": {"cpu": {"size": -1}}}),
    ("cpu size missing", {"tiers": {"cpu": {}}}),
    ("tokensPerBlock zero", {"tokensPerBlock": 0}),
    ("port out of range", {"agent": {"ports": {"http": 70000}}}),
    ("relative ssd path", {"tiers": {"cpu": {"size": 1}, "ssd": {"size": "1Gi", "paths": ["x"]}}}),
    ("ssd without paths", {"tiers": {"cpu": {"size": 1}, "ssd": {"size": "1Gi"}}}),
    ("negative cacheEpoch", {"cacheEpoch": -1}),
    ("watermark above 1", {"eviction": {"highWatermark": 1.5}}),
    ("no copy lanes", {"tiers": {"cpu": {"size": 1, "copyLanes": 0}}}),
    ("too many copy lanes", {"tiers": {"cpu": {"size": 1, "copyLanes": 65}}}),
]


@pytest.mark.parametrize("spec", [s for _, s in BAD_BY_SCHEMA], ids=[n for n, _ in BAD_BY_SCHEMA])
def test_schema_rejects_bad_specs(spec: dict[str, Any]) -> None:
    doc = _pool()
    doc["spec"].update(copy.deepcopy(spec))
    assert schema_errors(crds.POOL_PLURAL, doc) != []


BAD_BY_CEL = [
    (
        "lease not above renew",
        {"leaderElection": {"leaseDurationSeconds": 10, "renewDeadlineSeconds": 10}},
        "leaseDurationSeconds > renewDeadlineSeconds",
    ),
    (
        "renew not above retry",
        {"leaderElection": {"renewDeadlineSeconds": 2, "retryPeriodSeconds": 2}},
        "renewDeadlineSeconds > retryPeriodSeconds",
    ),
    (
        "watermarks inverted",
        {"eviction": {"lowWatermark": 0.9, "highWatermark": 0.8}},
        "lowWatermark must be below",
    ),
    ("same ports", {"agent": {"ports": {"http": 9000, "fanout": 9000}}}, "must differ"),
    (
        "fan-out wait not below the engine call",
        {"timeouts": {"engineCallSeconds": 5, "fanoutWaitSeconds": 5}},
        "fanoutWaitSeconds must be below",
    ),
    (
        "flexkv unpinned",
        {"backend": "flexkv", "tiers": {"cpu": {"size": "1Gi", "pinned": False}}},
        "pinned",
    ),
    (
        "flexkv with copy lanes",
        {"backend": "flexkv", "tiers": {"cpu": {"size": "1Gi", "copyLanes": 4}}},
        "copyLanes applies to backend embedded",
    ),
]


@pytest.mark.parametrize(
    ("spec", "message"), [(s, m) for _, s, m in BAD_BY_CEL], ids=[n for n, _, _ in BAD_BY_CEL]
)
def test_cel_rules_reject_cross_field_mistakes(spec: dict[str, Any], message: str) -> None:
    doc = _pool()
    doc["spec"].update(copy.deepcopy(spec))
    assert schema_errors(crds.POOL_PLURAL, doc) == []  # each field alone is fine
    violations = cel_violations(crds.POOL_PLURAL, doc)
    assert len(violations) == 1 and message in violations[0], violations


def test_cel_accepts_the_default_timings() -> None:
    assert cel_violations(crds.POOL_PLURAL, _pool()) == []


# --- admission that matches what the operator and the API server accept later ----------


def refusals(plural: str, doc: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    return schema_errors(plural, doc) + cel_violations(plural, doc, old)


def _with_spec(**spec: Any) -> dict[str, Any]:
    doc = _pool()
    doc["spec"].update(copy.deepcopy(spec))
    return doc


def _ssd(*paths: str, size: object = "1Gi") -> dict[str, Any]:
    return _with_spec(tiers={"cpu": {"size": "1Gi"}, "ssd": {"size": size, "paths": list(paths)}})


REFUSED_POOLS = [
    ("cpu size 0Gi", _with_spec(tiers={"cpu": {"size": "0Gi"}})),
    ("cpu size '0'", _with_spec(tiers={"cpu": {"size": "0"}})),
    ("cpu size 0", _with_spec(tiers={"cpu": {"size": 0}})),
    ("cpu size 100000Ei", _with_spec(tiers={"cpu": {"size": "100000Ei"}})),
    ("cpu size half a byte", _with_spec(tiers={"cpu": {"size": "0.5"}})),
    ("cpu size not a quantity", _with_spec(tiers={"cpu": {"size": "lots"}})),
    ("cpu size 8GB", _with_spec(tiers={"cpu": {"size": "8GB"}})),
    ("ssd size 0Gi", _ssd("/mnt/nvme0/flexkv", size="0Gi")),
    ("ssd path /", _ssd("/")),
    ("ssd path /etc/flexkv", _ssd("/etc/flexkv")),
    ("ssd path /var", _ssd("/var")),
    ("ssd path escaping with ..", _ssd("/mnt/../etc")),
    ("ssd path trailing /", _ssd("/mnt/nvme0/")),
    ("ssd path //", _ssd("/mnt//nvme0")),
    ("ssd path relative", _ssd("mnt/nvme0")),
    ("ssd path kubelet state", _ssd("/var/lib/kubelet/pods")),
    ("maxUnavailable 0%", _with_spec(agent={"maxUnavailable": "0%"})),
    ("maxUnavailable 150%", _with_spec(agent={"maxUnavailable": "150%"})),
    ("maxUnavailable 0", _with_spec(agent={"maxUnavailable": 0})),
    ("resource not a quantity", _with_spec(agent={"resources": {"requests": {"cpu": "lots"}}})),
    (
        "request above limit",
        _with_spec(
            agent={"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}
        ),
    ),
    ("nodeSelector key with a space", _with_spec(placement={"nodeSelector": {"bad key": "x"}})),
    ("nodeSelector value with a space", _with_spec(placement={"nodeSelector": {"k": "a b"}})),
    ("toleration operator mistyped", _with_spec(placement={"tolerations": [{"operator": "Is"}]})),
    (
        "toleration seconds mistyped",
        _with_spec(placement={"tolerations": [{"tolerationSeconds": "5"}]}),
    ),
]


@pytest.mark.parametrize("doc", [d for _, d in REFUSED_POOLS], ids=[n for n, _ in REFUSED_POOLS])
def test_admission_refuses_what_fails_later(doc: dict[str, Any]) -> None:
    assert refusals(crds.POOL_PLURAL, doc) != []


ACCEPTED_POOLS = [
    ("cpu size 8e9", _with_spec(tiers={"cpu": {"size": "8e9"}})),
    ("cpu size 8E9", _with_spec(tiers={"cpu": {"size": "8E9"}})),
    ("cpu size 1.5Gi", _with_spec(tiers={"cpu": {"size": "1.5Gi"}})),
    ("cpu size 500M", _with_spec(tiers={"cpu": {"size": "500M"}})),
    ("cpu size in bytes", _with_spec(tiers={"cpu": {"size": 8589934592}})),
    ("ssd in a dedicated directory", _ssd("/mnt/nvme0/flexkv", "/data/flexkv", size="1e11")),
    ("maxUnavailable 100%", _with_spec(agent={"maxUnavailable": "100%"})),
    ("maxUnavailable 1%", _with_spec(agent={"maxUnavailable": "1%"})),
    ("maxUnavailable 3", _with_spec(agent={"maxUnavailable": 3})),
    (
        "resources as quantities",
        _with_spec(
            agent={
                "resources": {
                    "requests": {"cpu": "500m", "memory": "1Gi"},
                    "limits": {"cpu": 2, "memory": "1073741824"},
                }
            }
        ),
    ),
    (
        "labels with prefixes",
        _with_spec(placement={"nodeSelector": {"node.kubernetes.io/instance-type": "g5.xlarge"}}),
    ),
    (
        "a full toleration",
        _with_spec(
            placement={
                "tolerations": [
                    {
                        "key": "gpu",
                        "operator": "Exists",
                        "effect": "NoExecute",
                        "tolerationSeconds": 5,
                    }
                ]
            }
        ),
    ),
]


@pytest.mark.parametrize("doc", [d for _, d in ACCEPTED_POOLS], ids=[n for n, _ in ACCEPTED_POOLS])
def test_admission_accepts_every_valid_form(doc: dict[str, Any]) -> None:
    assert refusals(crds.POOL_PLURAL, doc) == []
    parse_pool_spec(doc["spec"], "img")  # and the operator accepts it too


@pytest.mark.parametrize(
    "name",
    ["a.b", "Pool", "1pool", "pool-", "p" * 52],
)
def test_pool_names_that_cannot_name_services_are_refused(name: str) -> None:
    doc = _pool()
    doc["metadata"]["name"] = name
    assert any("metadata.name" in v for v in cel_violations(crds.POOL_PLURAL, doc))


def test_pool_name_of_51_characters_is_accepted() -> None:
    doc = _pool()
    doc["metadata"]["name"] = "p" + "-x" * 25
    assert len(doc["metadata"]["name"]) == 51 and cel_violations(crds.POOL_PLURAL, doc) == []


SSD_PATHS = [
    "/",
    "/etc",
    "/etc/flexkv",
    "/var",
    "/var/lib",
    "/var/lib/flexkv",
    "/var/lib/kubelet/x",
    "/mnt",
    "/mnt/nvme0",
    "/mnt/nvme0/flexkv",
    "/mnt/../etc",
    "/mnt/./x",
    "/mnt/x/",
    "/mnt//x",
    "/dev/shm",
    "/dev/shm/x",
    "/tmp/x",
    "/var/run/flexkv",
    "/home",
    "/home/u/cache",
    "/data",
    "/usr/local/cache",
    "/opt/flexkv",
    "/run/x",
    "/srv/cache",
    "/media",
    "/mnt/x/..",
]


@pytest.mark.parametrize("path", SSD_PATHS)
def test_ssd_path_rules_match_the_operators_check(path: str) -> None:
    """The CRD's CEL rules and the operator's host_paths check refuse the same paths."""
    refused_by_crd = refusals(crds.POOL_PLURAL, _ssd(path)) != []
    assert refused_by_crd == (ssd_path_problem(path) is not None)


def test_operator_refuses_what_the_crd_refuses_for_max_unavailable() -> None:
    for bad in ("0%", "150%", 0):
        with pytest.raises(ConfigInvalid, match="maxUnavailable"):
            parse_pool_spec(
                {"tiers": {"cpu": {"size": "1Gi"}}, "agent": {"maxUnavailable": bad}}, "i"
            )


def _group(**status: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "flexkv.io/v1alpha1",
        "kind": "KVCacheGroup",
        "metadata": {"name": "pool-r0"},
        "spec": {"poolRef": "pool", "replica": "r0", "ppSize": 2},
    }
    if status:
        doc["status"] = status
    return doc


def _member(node: str, rank: int) -> dict[str, Any]:
    return {"node": node, "ppRank": rank}


REFUSED_GROUPS = [
    ("empty poolRef", {**_group(), "spec": {"poolRef": "", "replica": "r0", "ppSize": 2}}),
    ("empty replica", {**_group(), "spec": {"poolRef": "pool", "replica": "", "ppSize": 2}}),
    ("leader rank not below ppSize", _group(epoch=1, leader=_member("a", 2))),
    ("negative leader rank", _group(epoch=1, leader=_member("a", -1))),
    ("negative member rank", _group(members=[_member("a", -1)])),
    ("duplicate members", _group(members=[_member("a", 0), _member("a", 0)])),
]


@pytest.mark.parametrize("doc", [d for _, d in REFUSED_GROUPS], ids=[n for n, _ in REFUSED_GROUPS])
def test_group_invariants_are_enforced(doc: dict[str, Any]) -> None:
    assert refusals(crds.GROUP_PLURAL, doc) != []


def test_a_valid_group_is_accepted() -> None:
    doc = _group(epoch=3, leader=_member("a", 1), members=[_member("a", 1), _member("b", 0)])
    assert refusals(crds.GROUP_PLURAL, doc) == []


def test_group_pool_ref_and_replica_are_immutable() -> None:
    old = _group()
    assert refusals(crds.GROUP_PLURAL, _group(), old) == []
    for field, value in (("poolRef", "other"), ("replica", "r1")):
        new = copy.deepcopy(old)
        new["spec"][field] = value
        assert any("immutable" in v for v in refusals(crds.GROUP_PLURAL, new, old)), field
    grown = copy.deepcopy(old)
    grown["spec"]["ppSize"] = 4  # the operator may still change ppSize
    assert refusals(crds.GROUP_PLURAL, grown, old) == []


@pytest.mark.parametrize("plural", [crds.POOL_PLURAL, crds.GROUP_PLURAL])
def test_every_field_has_a_description(plural: str) -> None:
    """kubectl explain shows a description for every field of spec and status."""
    missing = [
        path or "<root>" for path, node in _walk(crds.schema(plural)) if not node.get("description")
    ]
    assert missing == []

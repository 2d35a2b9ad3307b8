"""The names and rules the operator and the agents agree on (node_agent/contract)
against docs/contracts.md, and both sides reading sizes alike.

The doc's section 7 table lists every shared constant with its value; the checks
here compare that table with the code in both directions, and the prose of the
sections above with the table's constants, so a key renamed in one place (code or
doc) fails.
"""

from __future__ import annotations

import ast
import re
from decimal import Decimal
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from flexkv_operator import crds, names
from flexkv_operator.quantity import parse_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.config import ConfigError, parse_quantity
from node_agent.contract import files, kube, mooncake, quantity

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "contracts.md"
MODULES: dict[str, ModuleType] = {
    "kube": kube, "files": files, "mooncake": mooncake, "quantity": quantity,
}
_ROW = re.compile(r"^\| `(?P<expr>[^`]+)` \| `(?P<value>[^`]+)` \|$")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


def _sections(text: str) -> dict[str, str]:
    """The doc's ``## N. Title`` sections by number."""
    parts = re.split(r"^## (\d+)\. .*$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _table(section: str) -> dict[str, str]:
    return {m["expr"]: m["value"] for m in map(_ROW.match, section.splitlines()) if m}


def _evaluate(expr: str) -> Any:
    """``module.NAME``, ``module.NAME["key"]`` or ``module.func("a", ...)``, looked up
    in the contract package (literal arguments only)."""
    node = ast.parse(expr, mode="eval").body
    if isinstance(node, ast.Call):
        func = _evaluate(ast.unparse(node.func))
        return func(*(ast.literal_eval(a) for a in node.args))
    if isinstance(node, ast.Subscript):
        return _evaluate(ast.unparse(node.value))[ast.literal_eval(node.slice)]
    assert isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name), expr
    return getattr(MODULES[node.value.id], node.attr)


def _matches(value: Any, written: str) -> bool:
    """Whether the doc's ``written`` form states ``value``."""
    if isinstance(value, str):
        return value == written
    if isinstance(value, int | Decimal):
        return quantity.parse_quantity(written) == value
    if isinstance(value, dict):
        return ", ".join(value) == written
    if isinstance(value, tuple):
        ranges = [_RANGE.match(part) for part in written.split(", ")]
        return all(ranges) and tuple(
            (int(r[1]), int(r[2])) for r in ranges if r
        ) == value
    return False


def _shared_names() -> set[str]:
    """Every public constant and function of the contract modules, as ``module.NAME``."""
    found = set()
    for prefix, module in MODULES.items():
        for name, value in vars(module).items():
            if name.startswith("_") or isinstance(value, ModuleType) or name == "annotations":
                continue
            defined_here = getattr(value, "__module__", None) == module.__name__
            if name.isupper() or (callable(value) and defined_here):
                found.add(f"{prefix}.{name}")
    return found


def table_problems(text: str) -> list[str]:
    """Where the section 7 table and the contract modules disagree."""
    table = _table(_sections(text)["7"])
    problems = []
    for expr, written in table.items():
        try:
            value = _evaluate(expr)
        except (AttributeError, KeyError) as exc:
            problems.append(f"{expr}: not in node_agent.contract ({exc})")
            continue
        if not _matches(value, written):
            problems.append(f"{expr}: the code has {value!r}, the doc {written!r}")
    documented = {re.split(r"[\[(]", expr)[0] for expr in table}
    # Derived groupings of documented constants need no row of their own.
    undocumented = _shared_names() - documented - {"kube.LEASE_ANNOTATIONS", "quantity.SUFFIXES"}
    problems += [f"{name}: missing from the table" for name in sorted(undocumented)]
    return problems


def _spans(section: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", section)


def prose_problems(text: str) -> list[str]:
    """Where sections 1 to 4 name something other than the shared constants."""
    sections = _sections(text)
    problems = []
    lease = sections["2"]
    keys = {s for s in _spans(lease) if re.fullmatch(r"flexkv\.io/[a-z-]+", s)}
    if keys != set(kube.LEASE_ANNOTATIONS):
        problems.append(f"section 2 annotations {sorted(keys)} != {list(kube.LEASE_ANNOTATIONS)}")
    labels = dict(s.split(": ", 1) for s in _spans(lease.split("\n- labels", 1)[1].split(";")[0]))
    expected = {kube.LABEL_NAME: kube.AGENT_APP, kube.LABEL_POOL: "<pool>",
                kube.LABEL_NODE: "<nodeName>"}
    if labels != expected:
        problems.append(f"section 2 labels {labels} != {expected}")
    if kube.lease_name("<nodeName>") not in _spans(lease):
        problems.append(f"section 2 does not name the Lease {kube.lease_name('<nodeName>')}")
    if f"{kube.LABEL_POOL}: <pool>" not in _spans(sections["3"]):
        problems.append(f"section 3 does not label groups {kube.LABEL_POOL}")
    example = yaml.safe_load(sections["1"].split("```yaml", 1)[1].split("```", 1)[0])
    if (example["engineSocket"], example["curveKeyDir"]) != (files.ENGINE_SOCKET,
                                                             files.CURVE_MOUNT):
        problems.append("section 1's engineSocket or curveKeyDir is not the agent's default")
    for var, key in files.DOWNWARD_ENV.items():
        if var not in _spans(sections["1"]) or key not in _spans(sections["1"]):
            problems.append(f"section 1 does not say that {var} fills {key}")
    curve = _spans(sections["4"])
    for name in (files.CURVE_PUBLIC_KEY, files.CURVE_SECRET_KEY, files.ENV_CURVE_PUBLIC_KEY,
                 files.ENV_CURVE_SECRET_KEY):
        if name not in curve:
            problems.append(f"section 4 does not name {name}")
    return problems


def test_the_shared_names_are_the_ones_contracts_md_lists() -> None:
    assert table_problems(DOC.read_text()) == []


def test_contracts_md_sections_use_the_shared_names() -> None:
    assert prose_problems(DOC.read_text()) == []


@pytest.mark.parametrize(("old", "new"), [
    ("`flexkv.io/ready`", "`flexkv.io/readiness`"),
    ("`kube.LABEL_NODE` | `flexkv.io/node`", "`kube.LABEL_NODE` | `flexkv.io/nodename`"),
    ("`flexkv-agent-<nodeName>`;", "`agent-<nodeName>`;"),
    ("`curve-secret.key`.", "`curve-private.key`."),
])
def test_a_name_renamed_in_the_doc_alone_fails_the_check(old: str, new: str) -> None:
    text = DOC.read_text()
    assert old in text
    changed = text.replace(old, new, 1)
    assert table_problems(changed) + prose_problems(changed) != []


def test_a_name_renamed_in_the_code_alone_fails_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kube, "ANNOTATION_TIERS", "flexkv.io/tier-stats")
    assert table_problems(DOC.read_text()) == [
        "kube.ANNOTATION_TIERS: the code has 'flexkv.io/tier-stats', the doc 'flexkv.io/tiers'"
    ]
    monkeypatch.setattr(kube, "NEW_LABEL", "flexkv.io/new", raising=False)
    assert "kube.NEW_LABEL: missing from the table" in table_problems(DOC.read_text())


def test_the_operator_uses_the_shared_names() -> None:
    """The operator's names are the contract's objects, not copies that could drift."""
    assert names.group_name is kube.group_name and names.lease_name is kube.lease_name
    assert (names.ANNOTATION_READY, names.LABEL_POOL, names.CURVE_MOUNT) == (
        kube.ANNOTATION_READY, kube.LABEL_POOL, files.CURVE_MOUNT)
    assert (crds.API_VERSION, crds.GROUP_PLURAL) == (kube.API_VERSION, kube.GROUP_PLURAL)


# --- sizes: one grammar on both sides ----------------------------------------------

# Each of these the operator accepts in a pool and renders into agent.yaml as written.
OPERATOR_SIZES = [
    ("8Gi", 8 << 30), ("+1Ki", 1024), (".5Ki", 512), ("1.Ki", 1024), ("2000m", 2),
    ("1.1k", 1100), ("1.5e3", 1500), ("8E9", 8 * 10**9), (" 8Gi ", 8 << 30),
    ("9007199254740993", 9007199254740993), ("7Ei", 7 << 60),
]


@pytest.mark.parametrize(("text", "value"), OPERATOR_SIZES)
def test_the_agent_reads_a_size_as_the_operator_does(text: str, value: int) -> None:
    assert parse_bytes(text, "spec.tiers.cpu.size") == value
    assert parse_quantity(text, "tiers.cpu.size") == value


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.from_regex(
    r"\A[+-]?([0-9]{1,20}(\.[0-9]{0,6})?|\.[0-9]{1,6})"
    r"([eE][+-]?[0-9]{1,2}|Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?\Z"))
def test_every_size_the_operator_accepts_means_the_same_bytes_to_the_agent(text: str) -> None:
    try:
        expected = parse_bytes(text, "f")
    except ValueError:
        return
    assert parse_quantity(text, "f") == expected


@pytest.mark.parametrize(("text", "fragment"), [
    ("8GB", "has unknown suffix 'GB'; use one of Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E"),
    ("8 Gi", "is not a quantity"),
    ("1e3Ki", "is not a quantity"),
    ("-1Gi", "is negative"),
    ("1m", "is not a whole number of bytes"),
    ("0.5", "is not a whole number of bytes"),
])
def test_the_agent_names_what_is_wrong_with_a_size(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_quantity(text, "tiers.cpu.size")
    assert str(info.value).startswith(f"tiers.cpu.size: {text!r} ")
    assert fragment in str(info.value)


def test_quantities_are_exact() -> None:
    assert quantity.parse_quantity("1.1k") == Decimal(1100)
    assert quantity.parse_quantity("1e1001") is None
    assert quantity.unknown_suffix("8GB") == "GB"
    assert quantity.unknown_suffix("8Gi") is None and quantity.unknown_suffix("lots") is None

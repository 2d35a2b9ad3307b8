"""CEL as the Kubernetes API server evaluates CRD validation rules, for the tests.

cel-python implements standard CEL; the API server adds libraries on top. This
module supplies the one the CRDs use, the quantity library (``isQuantity``,
``quantity``, ``sign``, ``isInteger``, ``compareTo``, ``isGreaterThan``,
``isLessThan``), and walks a CRD schema with an object the way the API server
does: every ``x-kubernetes-validations`` rule is evaluated with ``self`` bound to
its node (each item of an array, each value of a map), and transition rules
(those naming ``oldSelf``) only on update, when the old node exists. It also
checks ``x-kubernetes-list-type: map`` keys are unique, as the API server does.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import celpy
from celpy import celtypes
from flexkv_operator.quantity import INT64_MAX, parse_quantity


class Quantity:
    def __init__(self, value: Decimal) -> None:
        self.value = value


def _is_quantity(text: Any) -> celtypes.BoolType:
    return celtypes.BoolType(isinstance(text, str) and parse_quantity(str(text)) is not None)


def _quantity(text: Any) -> Quantity:
    value = parse_quantity(str(text))
    if value is None:
        raise ValueError(f"{text!r} is not a quantity")
    return Quantity(value)


def _sign(q: Quantity) -> celtypes.IntType:
    return celtypes.IntType((q.value > 0) - (q.value < 0))


def _is_integer(q: Quantity) -> celtypes.BoolType:
    return celtypes.BoolType(
        q.value == q.value.to_integral_value() and -INT64_MAX - 1 <= q.value <= INT64_MAX
    )


def _compare(a: Quantity, b: Quantity) -> celtypes.IntType:
    return celtypes.IntType((a.value > b.value) - (a.value < b.value))


FUNCTIONS = {
    "isQuantity": _is_quantity,
    "quantity": _quantity,
    "sign": _sign,
    "isInteger": _is_integer,
    "compareTo": _compare,
    "isGreaterThan": lambda a, b: celtypes.BoolType(a.value > b.value),
    "isLessThan": lambda a, b: celtypes.BoolType(a.value < b.value),
}
_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule), functions=FUNCTIONS)
    return _PROGRAMS[rule]


def evaluate(rule: str, self_value: Any, old_value: Any = None) -> bool:
    """One rule on one node; an evaluation error counts as a violation (as the server)."""
    bindings = {"self": celpy.json_to_cel(self_value)}
    if old_value is not None:
        bindings["oldSelf"] = celpy.json_to_cel(old_value)
    try:
        return bool(_program(rule).evaluate(bindings))
    except Exception:
        return False


def violations(schema: dict[str, Any], value: Any, old: Any = None, path: str = "") -> list[str]:
    """Messages of every rule ``value`` breaks (``old``: the stored object on update)."""
    found: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        if not evaluate(rule["rule"], value, old if transition else None):
            found.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                old_sub = old.get(key) if isinstance(old, dict) else None
                found.extend(violations(sub, value[key], old_sub, f"{path}.{key}"))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                found.extend(violations(extra, item, None, f"{path}[{key}]"))
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        keys = schema.get("x-kubernetes-list-map-keys")
        if schema.get("x-kubernetes-list-type") == "map" and keys:
            seen = [tuple(item.get(k) for k in keys) for item in value if isinstance(item, dict)]
            if len(set(seen)) != len(seen):
                found.append(f"{path}: duplicate entries for the keys {keys}")
        for index, item in enumerate(value):
            found.extend(violations(schema["items"], item, None, f"{path}[{index}]"))
    return found

"""Structural defaulting from the CRD schema, as the API server does it.

The API server fills ``default`` values of a structural schema on read and write.
The operator applies the same defaults itself (from the same CRD file) so that a
pool is interpreted identically whether or not the server defaulted it, for
example an emulated API server in tests.
"""

from __future__ import annotations

import copy
from typing import Any


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """Return a deep copy of ``obj`` with every missing defaulted field filled.

    Follows the Kubernetes rules: a property absent from an object gets its
    ``default`` (itself defaulted recursively); array items and
    ``additionalProperties`` values are defaulted by their item schema. Values of
    the wrong type are left alone (validation reports them).
    """
    return _apply(copy.deepcopy(obj), schema)


def _apply(obj: Any, schema: dict[str, Any]) -> Any:
    if isinstance(obj, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = _apply(obj[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            known = set(schema.get("properties", {}))
            for key in obj:
                if key not in known:
                    obj[key] = _apply(obj[key], extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [_apply(item, schema["items"]) for item in obj]
    return obj

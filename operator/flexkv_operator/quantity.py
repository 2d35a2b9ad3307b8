"""Kubernetes resource quantities (``8Gi``, ``500M``, ``1.5G``) as whole bytes."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_SUFFIX_LIST = ", ".join(suffix for suffix in _SUFFIXES if suffix)
# Longest suffixes first, so "Gi" is never read as "G" followed by junk.
_PATTERN = re.compile(
    r"^([0-9]+(?:\.[0-9]+)?)("
    + "|".join(re.escape(s) for s in sorted(_SUFFIXES, key=len, reverse=True) if s)
    + ")?$"
)


def parse_bytes(value: object, field: str) -> int:
    """Parse a size given as an integer or a quantity string into bytes.

    Raises ValueError naming ``field``, the bad value and the accepted forms.
    Fractions of a byte are rounded up.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field}: {value!r} is not a size; give bytes or a quantity like 8Gi")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{field}: {value} must be a positive number of bytes, e.g. 8Gi")
        return value
    if isinstance(value, str):
        match = _PATTERN.match(value.strip())
        if match:
            try:
                number = Decimal(match.group(1))
            except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
                number = Decimal(0)
            scaled = number * _SUFFIXES[match.group(2) or ""]
            whole = int(scaled) + (0 if scaled == int(scaled) else 1)
            if whole > 0:
                return whole
    raise ValueError(
        f"{field}: {value!r} is not a positive size; give bytes (8589934592) or a "
        f"quantity with a suffix from {_SUFFIX_LIST} (e.g. 8Gi)"
    )

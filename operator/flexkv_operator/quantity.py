"""Sizes in a pool's spec as whole bytes.

The quantity grammar is the one the agents read the same text with
(:mod:`node_agent.contract.quantity`, the API server's ``resource.Quantity``);
this module adds the operator's rule for a size: positive, whole and at most
2^63-1 bytes, which is what the CRD's CEL rule admits.
"""

from __future__ import annotations

from node_agent.contract.quantity import INT64_MAX, SUFFIXES, parse_quantity

__all__ = ["INT64_MAX", "parse_bytes", "parse_quantity"]

_SUFFIX_LIST = ", ".join(suffix for suffix in SUFFIXES if suffix)


def parse_bytes(value: object, field: str) -> int:
    """Parse a size given as an integer or a quantity string into whole bytes.

    Raises ValueError naming ``field``, the bad value and the accepted forms: the
    size must be positive, a whole number of bytes and at most 2^63-1 (what the
    CRD's CEL rule ``quantity(self).isInteger() && quantity(self).sign() == 1``
    admits)."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: {value!r} is not a size; give bytes or a quantity like 8Gi")
    if isinstance(value, int):
        if not 0 < value <= INT64_MAX:
            raise ValueError(f"{field}: {value} must be a positive number of bytes, e.g. 8Gi")
        return value
    if isinstance(value, str):
        number = parse_quantity(value.strip())
        whole = number is not None and number == number.to_integral_value()
        if number is not None and whole and 0 < number <= INT64_MAX:
            return int(number)
    raise ValueError(
        f"{field}: {value!r} is not a positive whole number of bytes up to 2^63-1; give "
        f"bytes (8589934592), an exponent (8e9) or a quantity with a suffix from "
        f"{_SUFFIX_LIST} (e.g. 8Gi)"
    )

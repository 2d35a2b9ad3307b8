"""Kubernetes resource quantities as exact numbers, and sizes as whole bytes.

The grammar is the API server's (``k8s.io/apimachinery`` ``resource.Quantity``)::

    <quantity>  ::= <sign>? <number> <suffix>
    <number>    ::= <digits> | <digits> "." <digits>? | "." <digits>
    <suffix>    ::= "" | binary SI (Ki Mi Gi Ti Pi Ei) | decimal SI (m k M G T P E)
                  | ("e" | "E") <sign>? <digits>

so ``8Gi``, ``500M``, ``1.5G``, ``8e9`` and ``.5Ki`` are all quantities. A CRD
checks them with CEL's ``isQuantity``/``quantity`` library; the operator reads
them here, with the same grammar.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
_SUFFIX_LIST = ", ".join(suffix for suffix in _SUFFIXES if suffix)
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<exponent>[eE][+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E))?$"
)
INT64_MAX = 2**63 - 1


def parse_quantity(text: str) -> Decimal | None:
    """The exact value of a quantity string, or None when it is not a quantity."""
    match = _QUANTITY.match(text)
    if match is None:
        return None
    try:
        number = Decimal(match.group("number"))
        if match.group("exponent"):
            exponent = int(match.group("exponent")[1:])
            if abs(exponent) > 1000:
                return None
            return number.scaleb(exponent)
        return number * _SUFFIXES[match.group("suffix") or ""]
    except InvalidOperation:
        return None


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

"""Kubernetes resource quantities as exact numbers.

The grammar is the API server's (``k8s.io/apimachinery`` ``resource.Quantity``)::

    <quantity>  ::= <sign>? <number> <suffix>
    <number>    ::= <digits> | <digits> "." <digits>? | "." <digits>
    <suffix>    ::= "" | binary SI (Ki Mi Gi Ti Pi Ei) | decimal SI (m k M G T P E)
                  | ("e" | "E") <sign>? <digits>

so ``8Gi``, ``500M``, ``1.5G``, ``8e9`` and ``.5Ki`` are all quantities. A CRD
checks them with CEL's ``isQuantity``/``quantity`` library; the operator reads a
pool's sizes and the agent reads the same text from its configuration with this
one grammar, so a size one side accepts means the same number of bytes to the
other. What range of values a field allows is each reader's rule.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

DECIMAL_SUFFIXES: dict[str, Decimal] = {"m": Decimal("0.001")} | {
    suffix: Decimal(10 ** (3 * power)) for power, suffix in enumerate("kMGTPE", start=1)
}
BINARY_SUFFIXES: dict[str, Decimal] = {
    f"{prefix}i": Decimal(2 ** (10 * power)) for power, prefix in enumerate("KMGTPE", start=1)
}
SUFFIXES: dict[str, Decimal] = {"": Decimal(1), **DECIMAL_SUFFIXES, **BINARY_SUFFIXES}
#: The largest quantity the API server keeps exactly, and the largest byte count.
INT64_MAX = 2**63 - 1

_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_QUANTITY = re.compile(
    rf"^(?P<number>{_NUMBER})"
    r"(?:(?P<exponent>[eE][+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E))?$"
)
_LETTERS = re.compile(rf"^{_NUMBER}(?P<suffix>[A-Za-z]+)$")
#: Exponents beyond this are refused rather than expanded.
_MAX_EXPONENT = 1000


def parse_quantity(text: str) -> Decimal | None:
    """The exact value of a quantity string, or None when it is not a quantity."""
    match = _QUANTITY.match(text)
    if match is None:
        return None
    try:
        number = Decimal(match.group("number"))
        if match.group("exponent"):
            exponent = int(match.group("exponent")[1:])
            if abs(exponent) > _MAX_EXPONENT:
                return None
            return number.scaleb(exponent)
        return number * SUFFIXES[match.group("suffix") or ""]
    except InvalidOperation:
        return None


def unknown_suffix(text: str) -> str | None:
    """The letters after the number of ``text`` when they are no quantity suffix
    (``8GB`` gives ``GB``), else None (``text`` is a quantity, or not even a number
    followed by letters)."""
    match = _LETTERS.match(text)
    if match is None or parse_quantity(text) is not None:
        return None
    return match.group("suffix")

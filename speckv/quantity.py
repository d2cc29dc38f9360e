"""Byte sizes written as Kubernetes quantities: ``2Gi``, ``512Mi``, ``1.5Gi`` (binary),
``2G``, ``500M``, ``64k`` (decimal), ``1e9`` (an exponent) or plain bytes (``1048576``).

``parse_size`` returns a whole number of bytes (ValueError naming the accepted forms
otherwise); ``format_size`` writes the shortest exact binary form (``1Gi``, ``1536Mi``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
# the Kubernetes quantity grammar (resource.Quantity), without a sign or the milli suffix
QUANTITY = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
                      r"(?:(?P<suffix>[KMGTPE]i|[kMGTPE])|[eE](?P<exp>[+-]?[0-9]+))?")
FORMS = "bytes or a Kubernetes quantity such as 512Mi, 2Gi, 1.5Gi, 2G, 500M, 64k"


def parse_size(text: str) -> int:
    """Bytes of ``text`` (see the module docstring)."""
    m = QUANTITY.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a size: use {FORMS}")
    try:
        num = Decimal(m["num"])
    except InvalidOperation:  # pragma: no cover -- the pattern admits decimals only
        raise ValueError(f"{text!r} is not a size: use {FORMS}") from None
    suffix = m["suffix"] or ""
    if m["exp"] is not None:
        if abs(int(m["exp"])) > 30:
            raise ValueError(f"{text!r}: exponent out of range")
        value = num.scaleb(int(m["exp"]))
    else:
        value = num * (BINARY[suffix] if suffix in BINARY else DECIMAL[suffix])
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of bytes ({value})")
    return int(value)


def format_size(n: int) -> str:
    """``n`` bytes as the largest binary unit it is a whole multiple of (``1Gi``), else bytes."""
    for suffix, mult in reversed(BINARY.items()):
        if n and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)

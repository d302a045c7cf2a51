"""The one rule that keeps canonical bytes independent of the installed orjson: check its float form at import.

A canonical line and its digest decide verdicts: "the same put again" or "a conflicting put", and a replay
that is byte-identical to the store it rebuilds. Two nodes must therefore write the same bytes for the same
value whatever orjson each has installed. orjson changed how it writes a float of 1e16 or more between
3.11.6 (``1e16``) and 3.11.7 (``1e+16``). The dependency pin keeps every install on the later form. This
check turns an install that slipped past the pin (a vendored copy, a future release that changes again) into
a clear error at start-up instead of silently divergent digests.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from tokcap.errors import CanonicalEncodingError

__all__ = ["CANONICAL_FLOAT_PROBES", "require_canonical_floats"]

CANONICAL_FLOAT_PROBES: tuple[tuple[float, bytes], ...] = (
    (1e16, b"1e+16"),
    (1.2345678901234568e17, b"1.2345678901234568e+17"),
    (1e21, b"1e+21"),
    (1.7976931348623157e308, b"1.7976931348623157e+308"),
    (1e15, b"1000000000000000.0"),
    (1e-5, b"0.00001"),
    (1e-7, b"1e-7"),
    (5e-324, b"5e-324"),
    (0.1, b"0.1"),
    (1.0, b"1.0"),
    (-0.0, b"-0.0"),
)
"""Floats whose written form has differed between encoder versions, each with its canonical bytes."""


def require_canonical_floats(dumps: Callable[[float], bytes] = orjson.dumps) -> None:
    """Raise ``CanonicalEncodingError`` unless ``dumps`` writes every probe float in its canonical form."""
    for value, canonical in CANONICAL_FLOAT_PROBES:
        written = dumps(value)
        if written != canonical:
            version = (
                getattr(orjson, "__version__", "unknown") if dumps is orjson.dumps else "the given encoder"
            )
            raise CanonicalEncodingError(
                f"orjson {version} writes the float {value!r} as {written.decode(errors='replace')!r}, "
                f"not as tokcap's canonical {canonical.decode()!r}: lines and digests written here would differ "
                "from every other node's; install orjson>=3.12 (pip install -U 'orjson>=3.12')"
            )

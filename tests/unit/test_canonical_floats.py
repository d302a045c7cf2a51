"""Canonical bytes do not depend on the installed orjson: the float form is checked, and pinned by a digest."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from tests.factories import make_entry
from tokcap.errors import CanonicalEncodingError, ConfigError
from tokcap.log.canonical_json import CANONICAL_FLOAT_PROBES, require_canonical_floats


def _entry_with_large_floats() -> bytes:
    entry = make_entry(
        "r",
        "c",
        model="test-model",
        created_at=1700000000.0,
        log_probs=[-1e-7, -0.5],
        output_items=[{"type": "message", "score": 1e16, "tiny": 1e-5}],
        stats={"budget": 1.2345678901234568e17},
    )
    return entry.canonical_json()


def test_a_float_of_1e16_or_more_is_written_with_a_signed_exponent_in_the_canonical_line() -> None:
    line = _entry_with_large_floats()
    assert b'"score":1e+16' in line
    assert b'"budget":1.2345678901234568e+17' in line
    assert b'"tiny":0.00001' in line


def test_the_canonical_line_of_an_entry_with_floats_has_the_same_digest_on_every_node() -> None:
    digest = hashlib.sha256(_entry_with_large_floats()).hexdigest()
    assert digest == "dad796ce046f2a0e63e453cbe952213d736d60dccbe7c644494f3bf15e1b2f08"


def test_the_installed_orjson_writes_every_probe_float_canonically() -> None:
    require_canonical_floats()
    for value, canonical in CANONICAL_FLOAT_PROBES:
        assert orjson.dumps(value) == canonical


def _orjson_before_3_11_7(value: float) -> bytes:
    return orjson.dumps(value).replace(b"e+", b"e")


def test_an_encoder_that_writes_floats_otherwise_is_refused_with_the_value_and_the_fix() -> None:
    with pytest.raises(CanonicalEncodingError) as raised:
        require_canonical_floats(_orjson_before_3_11_7)
    message = str(raised.value)
    assert "1e16" in message and "1e+16" in message
    assert "orjson>=3.12" in message
    assert isinstance(raised.value, ConfigError)

"""The canonical encoding's fast path gives exactly the bytes of pydantic's JSON dump."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import uuid
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.factories import make_entry


class _Color(enum.Enum):
    RED = "red"


class _Text(str):
    pass


@dataclasses.dataclass
class _Point:
    x: int


def _slow_canonical(extra: dict[str, Any]) -> tuple[bytes, bytes]:
    entry = make_entry("r", "c", output_items=[{"type": "message", "meta": list(extra.values())}], **extra)
    return entry.canonical_json(), orjson.dumps(entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"when": datetime.datetime(2024, 1, 2, 3, 4, 5)},
        {"day": datetime.date(2024, 1, 1)},
        {"id": uuid.UUID(int=5)},
        {"color": _Color.RED},
        {"text": _Text("x")},
        {"point": _Point(1)},
        {"nested": [{"when": datetime.date(2024, 1, 1)}]},
        {"pair": (1, 2)},
        {"nan": float("nan")},
    ],
    ids=lambda extra: ",".join(extra) or "plain",
)
def test_values_orjson_renders_differently_from_pydantic_still_encode_like_pydantic(
    extra: dict[str, Any],
) -> None:
    fast, slow = _slow_canonical(extra)
    assert fast == slow


@given(
    prompt=st.lists(st.integers(0, 2**31), max_size=50),
    log_probs=st.lists(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False), max_size=20),
)
def test_the_fast_path_equals_the_pydantic_dump_for_any_token_arrays(
    prompt: list[int], log_probs: list[float]
) -> None:
    entry = make_entry("r", "c", prompt=prompt, generation=list(range(len(log_probs))), log_probs=log_probs)
    assert entry.canonical_json() == orjson.dumps(entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


def test_finite_log_probs_whose_sum_overflows_are_accepted() -> None:
    entry = make_entry("r", "c", generation=(1, 2), log_probs=(-1e308, -1e308))
    assert entry.generation_log_probs == [-1e308, -1e308]


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_a_non_finite_log_prob_is_refused_wherever_it_sits(bad: float) -> None:
    with pytest.raises(ValueError, match="non-finite"):
        make_entry("r", "c", generation=(1, 2, 3), log_probs=(-0.5, bad, -0.25))

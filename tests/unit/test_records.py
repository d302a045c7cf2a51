"""TokenEntry validation, its canonical encoding, and token extraction from model responses."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from factories import (
    assistant_message_item,
    chat_completions_payload,
    log_probs_for,
    make_entry,
    responses_payload,
    token_fields,
)
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tokcap.errors import NewerSchemaError, RecordValidationError, TokenExtractionError
from tokcap.log.records import (
    REQUIRED_TOKEN_FIELDS,
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    TOKEN_FIELDS,
    TokenEntry,
    extract_token_fields,
    find_token_fields,
    strip_token_arrays,
)


def _raw_entry(**overrides: Any) -> dict[str, Any]:
    """A decoded record as it would come off disk or the wire."""
    raw: dict[str, Any] = json.loads(make_entry().canonical_json())
    raw.update(overrides)
    return raw


# --- validation -------------------------------------------------------------------------------------------


def test_a_record_from_a_newer_schema_is_refused_with_a_message_to_upgrade_the_reader() -> None:
    raw = _raw_entry(schema_version=TOKEN_ENTRY_RECORD_SCHEMA_VERSION + 1)
    with pytest.raises(NewerSchemaError, match="upgrade"):
        TokenEntry.from_mapping(raw)


def test_a_newer_schema_line_is_refused_before_other_validation_errors_can_hide_it() -> None:
    raw = _raw_entry(schema_version=TOKEN_ENTRY_RECORD_SCHEMA_VERSION + 1, generation_log_probs=[])
    with pytest.raises(NewerSchemaError, match="upgrade"):
        TokenEntry.from_json(json.dumps(raw))


def test_direct_validation_also_refuses_a_newer_schema_with_a_message_to_upgrade() -> None:
    with pytest.raises(ValidationError, match="upgrade"):
        TokenEntry.model_validate(_raw_entry(schema_version=TOKEN_ENTRY_RECORD_SCHEMA_VERSION + 5))


def test_a_record_of_the_current_schema_version_is_accepted() -> None:
    entry = TokenEntry.from_mapping(_raw_entry(schema_version=TOKEN_ENTRY_RECORD_SCHEMA_VERSION))
    assert entry.schema_version == TOKEN_ENTRY_RECORD_SCHEMA_VERSION


def test_generation_ids_and_log_probs_of_different_length_are_refused() -> None:
    with pytest.raises(RecordValidationError, match="equal length"):
        TokenEntry.from_mapping(_raw_entry(generation_token_ids=[4, 5, 6], generation_log_probs=[-0.5]))


def test_the_length_check_is_also_applied_to_entries_built_in_code() -> None:
    with pytest.raises(ValidationError, match="equal length"):
        make_entry(generation=[4, 5], log_probs=[-0.5])


@pytest.mark.parametrize("index", [-1, 1, 7])
def test_a_token_item_index_outside_output_items_is_refused(index: int) -> None:
    with pytest.raises(ValidationError, match="token_item_index"):
        make_entry(output_items=[assistant_message_item()], token_item_index=index)


def test_a_token_item_index_without_any_output_items_is_refused() -> None:
    with pytest.raises(ValidationError, match="token_item_index"):
        make_entry(output_items=[], token_item_index=0)


def test_a_token_item_index_inside_output_items_is_accepted() -> None:
    items = [assistant_message_item("a", item_id="m0"), assistant_message_item("b", item_id="m1")]
    entry = make_entry(output_items=items, token_item_index=1)
    assert entry.token_item_index == 1
    assert entry.output_items[1]["id"] == "m1"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_log_prob_is_refused(bad: float) -> None:
    with pytest.raises(ValidationError, match="non-finite"):
        make_entry(generation=[4, 5], log_probs=[-0.25, bad])


def test_a_float_token_id_is_refused_rather_than_truncated() -> None:
    with pytest.raises(RecordValidationError):
        TokenEntry.from_mapping(_raw_entry(prompt_token_ids=[1, 2.5]))


def test_a_line_that_is_not_json_is_refused_as_a_record_error() -> None:
    with pytest.raises(RecordValidationError, match="not valid JSON"):
        TokenEntry.from_json(b'{"rollout_id": "r1", ')


def test_a_line_that_is_not_a_json_object_is_refused() -> None:
    with pytest.raises(RecordValidationError, match="JSON object"):
        TokenEntry.from_json(b"[1, 2, 3]")


def test_record_errors_carry_the_rollout_and_call_ids() -> None:
    with pytest.raises(RecordValidationError) as info:
        TokenEntry.from_mapping(_raw_entry(rollout_id="r-9", model_call_id="c-9", generation_log_probs=[]))
    assert info.value.rollout_id == "r-9"
    assert info.value.model_call_id == "c-9"


def test_record_errors_are_value_errors_for_callers_of_the_contract() -> None:
    with pytest.raises(ValueError):
        TokenEntry.from_mapping(_raw_entry(generation_log_probs=[]))


def test_unknown_fields_are_kept_through_a_round_trip() -> None:
    entry = make_entry(engine_version="v9", sampling={"temperature": 0.7})
    again = TokenEntry.from_json(entry.canonical_json())
    dumped = again.model_dump()
    assert dumped["engine_version"] == "v9"
    assert dumped["sampling"] == {"temperature": 0.7}
    assert b'"engine_version":"v9"' in entry.canonical_json()


# --- canonical encoding -----------------------------------------------------------------------------------


def test_canonical_json_has_sorted_keys_at_every_level() -> None:
    entry = make_entry(output_items=[{"zeta": 1, "alpha": {"y": 2, "b": 3}}], extra_z=1, extra_a=2)
    decoded = json.loads(entry.canonical_json())
    assert list(decoded) == sorted(decoded)
    assert list(decoded["output_items"][0]) == ["alpha", "zeta"]
    assert list(decoded["output_items"][0]["alpha"]) == ["b", "y"]


def test_canonical_json_has_no_trailing_newline_or_whitespace_padding() -> None:
    encoded = make_entry().canonical_json()
    assert not encoded.endswith(b"\n")
    assert b": " not in encoded
    assert b", " not in encoded


def test_canonical_json_does_not_depend_on_the_order_fields_were_given_in() -> None:
    forward = TokenEntry.from_mapping(_raw_entry())
    backward = TokenEntry.from_mapping(dict(reversed(list(_raw_entry().items()))))
    assert forward.canonical_json() == backward.canonical_json()
    assert forward.payload_digest() == backward.payload_digest()


def test_equal_payloads_have_equal_digests_and_different_payloads_different_ones() -> None:
    assert make_entry().payload_digest() == make_entry().payload_digest()
    assert make_entry().payload_digest() != make_entry(generation=[4, 6]).payload_digest()
    assert len(make_entry().payload_digest()) == 64


_json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8)
_finite_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)


@given(
    prompt=st.lists(st.integers(0, 2**31 - 1), max_size=20),
    generation_and_probs=st.integers(0, 20).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n),
            st.lists(_finite_floats, min_size=n, max_size=n),
        )
    ),
    created_at=_finite_floats,
    extras=st.dictionaries(
        st.text(min_size=1, max_size=6).map(lambda key: f"x_{key}"), _json_scalars, max_size=3
    ),
    routed_experts=st.none() | st.lists(st.lists(st.integers(0, 255), max_size=4), max_size=4),
)
def test_canonical_json_round_trips_byte_identical_with_float64_precision(
    prompt: list[int],
    generation_and_probs: tuple[list[int], list[float]],
    created_at: float,
    extras: dict[str, Any],
    routed_experts: Any,
) -> None:
    generation, probs = generation_and_probs
    entry = make_entry(
        prompt=prompt,
        generation=generation,
        log_probs=probs,
        created_at=created_at,
        routed_experts=routed_experts,
        **extras,
    )
    encoded = entry.canonical_json()
    again = TokenEntry.from_json(encoded)
    assert again.canonical_json() == encoded
    assert again.payload_digest() == entry.payload_digest()
    assert again.generation_log_probs == probs
    assert [math.copysign(1.0, p) for p in again.generation_log_probs] == [
        math.copysign(1.0, p) for p in probs
    ]
    assert again.created_at == created_at


# --- extraction from model responses ----------------------------------------------------------------------


def test_extraction_finds_the_one_responses_api_item_that_carries_token_ids() -> None:
    carrier = {**assistant_message_item("hi"), **token_fields([1, 2], [3, 4, 5]), "routed_experts": [[0, 1]]}
    payload = responses_payload({"type": "reasoning", "id": "rs_0", "summary": []}, carrier)
    found = find_token_fields(payload)
    assert found is not None
    assert found.item_index == 1
    assert found.prompt_token_ids == [1, 2]
    assert found.generation_token_ids == [3, 4, 5]
    assert found.generation_log_probs == log_probs_for([3, 4, 5])
    assert found.routed_experts == [[0, 1]]


def test_extraction_finds_the_chat_completions_message_that_carries_token_ids() -> None:
    plain = {"role": "assistant", "content": "first"}
    carrier = {"role": "assistant", "content": "second", **token_fields([7], [8, 9])}
    found = find_token_fields(chat_completions_payload(plain, carrier))
    assert found is not None
    assert found.item_index == 1
    assert found.prompt_token_ids == [7]
    assert found.generation_token_ids == [8, 9]
    assert found.routed_experts is None


def test_extraction_returns_none_when_no_item_carries_token_ids() -> None:
    assert extract_token_fields(responses_payload(assistant_message_item())) is None
    assert extract_token_fields(chat_completions_payload({"role": "assistant", "content": "x"})) is None


def test_extraction_returns_none_for_a_payload_without_output_or_choices() -> None:
    assert extract_token_fields({"id": "resp_0", "error": {"message": "boom"}}) is None


def test_token_fields_set_to_null_count_as_absent() -> None:
    item = {**assistant_message_item(), **dict.fromkeys(TOKEN_FIELDS)}
    assert extract_token_fields(responses_payload(item)) is None


def test_extraction_refuses_a_response_where_two_items_carry_token_ids() -> None:
    first = {**assistant_message_item(item_id="m0"), **token_fields([1], [2])}
    second = {**assistant_message_item(item_id="m1"), **token_fields([1], [3])}
    with pytest.raises(TokenExtractionError, match="exactly one"):
        extract_token_fields(responses_payload(first, second))


def test_extraction_refuses_two_chat_choices_that_both_carry_token_ids() -> None:
    first = {"role": "assistant", "content": "a", **token_fields([1], [2])}
    second = {"role": "assistant", "content": "b", **token_fields([1], [3])}
    with pytest.raises(TokenExtractionError, match="exactly one"):
        extract_token_fields(chat_completions_payload(first, second))


@pytest.mark.parametrize("missing", REQUIRED_TOKEN_FIELDS)
def test_extraction_refuses_partial_token_metadata_and_names_what_is_missing(missing: str) -> None:
    item = {**assistant_message_item(), **token_fields([1, 2], [3])}
    del item[missing]
    with pytest.raises(TokenExtractionError, match=missing):
        extract_token_fields(responses_payload(item))


def test_extraction_refuses_token_fields_that_are_not_lists() -> None:
    item = {**assistant_message_item(), **token_fields([1], [2]), "prompt_token_ids": "1 2"}
    with pytest.raises(TokenExtractionError, match="not lists"):
        find_token_fields(responses_payload(item))


def test_extraction_errors_are_value_errors() -> None:
    item = {**assistant_message_item(), "prompt_token_ids": [1]}
    with pytest.raises(ValueError):
        extract_token_fields(responses_payload(item))


def test_stripping_removes_the_token_arrays_and_keeps_the_content() -> None:
    item = {**assistant_message_item("kept"), **token_fields([1], [2]), "routed_experts": [[1]]}
    stripped = strip_token_arrays(item)
    assert stripped == assistant_message_item("kept")
    assert "prompt_token_ids" in item

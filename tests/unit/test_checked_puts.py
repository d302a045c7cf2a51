"""The one-pass put path gives exactly what the reference path gives: the same line, digest, models and refusals.

The reference encoder lives here, not in the library: pydantic's JSON-mode dump serialized by orjson with sorted
keys, the encoding ``TokenEntry.canonical_json`` documents. The reference doors are the validated ones:
``accept_entry`` then a validated ``PutEvent`` for a sink, ``accept_event`` for a reader.
"""

from __future__ import annotations

import copy
import datetime
import enum
import hashlib
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokcap.errors import InvalidInputError
from tokcap.log.checked_puts import accept_put, accept_put_or_event
from tokcap.log.events import Event, PutEvent
from tokcap.log.input_rules import accept_entry, accept_event
from tokcap.log.records import TokenEntry


def reference_line(entry: TokenEntry) -> bytes:
    """The canonical line as the docs define it: pydantic's JSON-mode dump, orjson, sorted keys."""
    return orjson.dumps(entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


def reference_put(entry: object, writer: str) -> PutEvent:
    checked = accept_entry(entry)
    if writer:
        return PutEvent(rollout_id=checked.rollout_id, writer=writer, entry=checked)
    return PutEvent(rollout_id=checked.rollout_id, entry=checked)


def same(left: Any, right: Any) -> bool:
    """Equal values of identical types all the way down (``1 == 1.0 == True`` would hide a changed byte)."""
    if type(left) is not type(right):
        return False
    if isinstance(left, TokenEntry | PutEvent):
        return (
            same(dict(left.__dict__), dict(right.__dict__))
            and list(left.__dict__) == list(right.__dict__)
            and same(left.__pydantic_extra__, right.__pydantic_extra__)
            and left.__pydantic_fields_set__ == right.__pydantic_fields_set__
            and left.__pydantic_private__ == right.__pydantic_private__
        )
    if isinstance(left, dict):
        return list(left) == list(right) and all(same(left[key], right[key]) for key in left)
    if isinstance(left, list):
        return len(left) == len(right) and all(same(a, b) for a, b in zip(left, right, strict=True))
    if isinstance(left, float) and left != left:
        return right != right
    return bool(left == right)


def _model_fields(event: PutEvent) -> dict[str, Any]:
    """The event's fields without the cached line and digest, which a fast event may hold already."""
    return {
        key: value for key, value in event.__dict__.items() if key not in ("entry_line", "payload_digest")
    }


def outcome(call: Any) -> tuple[str, Any]:
    try:
        return "ok", call()
    except InvalidInputError as exc:
        return "refused", (type(exc), str(exc), exc.rollout_id, exc.model_call_id)


_EDGE_FLOATS = st.sampled_from(
    [1e16, -1e16, 1.2345678901234568e17, 1e21, 1e-7, 5e-324, -0.0, 0.1, 1e15, 1e308]
)
_FLOATS = st.one_of(_EDGE_FLOATS, st.floats(allow_nan=False, allow_infinity=False))
_TEXT = st.text(max_size=12)
_IDS = st.lists(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 200_000)), max_size=40)
_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), _FLOATS, _TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)),
    max_leaves=12,
)
_EXTRA_KEYS = _TEXT.filter(lambda key: key not in TokenEntry.model_fields)


@st.composite
def entries(draw: st.DrawFn) -> dict[str, Any]:
    """An entry's fields as a sink is given them: plain values, edge floats, unicode, extras, lineage."""
    generation = draw(_IDS)
    items = draw(st.lists(st.dictionaries(_TEXT, _JSON, max_size=3), max_size=3))
    fields: dict[str, Any] = {
        "rollout_id": draw(st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,12}", fullmatch=True)),
        "model_call_id": draw(st.text(min_size=1, max_size=12).filter(str.isprintable)),
        "prompt_token_ids": draw(_IDS),
        "generation_token_ids": generation,
        "generation_log_probs": draw(st.lists(_FLOATS, min_size=len(generation), max_size=len(generation))),
        "model": draw(_TEXT),
        "output_items": items,
        "created_at": draw(_FLOATS),
        "response_id": draw(st.none() | _TEXT),
        "routed_experts": draw(
            st.none() | st.lists(st.lists(st.integers(0, 255), max_size=4), max_size=4) | _JSON
        ),
        "token_item_index": draw(st.none() | st.integers(0, max(len(items) - 1, 0))) if items else None,
        "cum_len": draw(st.none() | st.integers(0, 2**40)),
        "digest": draw(st.none() | _TEXT),
        "continuation_fingerprint": draw(_TEXT),
        "continuation_context_len": draw(st.integers(0, 2**62)),
        "fingerprint_version": draw(st.none() | st.integers(0, 3)),
        "prefix_requested": draw(st.booleans()),
        "prefix_supplied": draw(st.booleans()),
    }
    lineage = draw(st.sampled_from(["none", "root", "unresolved", "resolved", "delta"]))
    if lineage in ("root", "unresolved"):
        fields["parent_resolution"] = lineage
    elif lineage in ("resolved", "delta"):
        fields["parent_resolution"] = "resolved"
        fields["parent_call_id"] = draw(st.text(min_size=1, max_size=8))
        fields["prompt_is_delta"] = lineage == "delta"
    fields.update(draw(st.dictionaries(_EXTRA_KEYS, _JSON, max_size=3)))
    return fields


class _Id(enum.IntEnum):
    SEVEN = 7


class _Int(int):
    pass


def _break(fields: dict[str, Any], how: str) -> dict[str, Any]:
    """The fields to change so that a sink must refuse the entry, or the fast pass must leave it to the reference."""
    broken = copy.deepcopy(fields)
    if how == "bool id":
        broken["prompt_token_ids"] = [*broken["prompt_token_ids"], True]
    elif how == "negative id":
        broken["generation_token_ids"] = [-1]
        broken["generation_log_probs"] = [-0.5]
    elif how == "float id":
        broken["prompt_token_ids"] = [5.0]
    elif how == "huge id":
        broken["prompt_token_ids"] = [2**64]
    elif how == "enum id":
        broken["prompt_token_ids"] = [*broken["prompt_token_ids"], _Id.SEVEN]
    elif how == "int subclass id":
        broken["prompt_token_ids"] = [_Int(3)]
    elif how == "int log prob":
        broken["generation_token_ids"] = [1]
        broken["generation_log_probs"] = [0]
    elif how == "nan log prob":
        broken["generation_token_ids"] = [1]
        broken["generation_log_probs"] = [float("nan")]
    elif how == "int created_at":
        broken["created_at"] = 3
    elif how == "infinite created_at":
        broken["created_at"] = float("inf")
    elif how == "nan extra":
        broken["zz_extra"] = {"deep": [1.0, float("nan")]}
    elif how == "nan output item":
        broken["output_items"] = [{"x": float("-inf")}]
    elif how == "empty call id":
        broken["model_call_id"] = ""
    elif how == "newline call id":
        broken["model_call_id"] = "a\nb"
    elif how == "bad rollout id":
        broken["rollout_id"] = "../x"
    elif how == "tuple ids":
        broken["prompt_token_ids"] = tuple(broken["prompt_token_ids"])
    elif how == "datetime extra":
        broken["zz_when"] = datetime.datetime(2024, 1, 2, 3, 4, 5)
    elif how == "int rollout id":
        broken["rollout_id"] = 5
    return {
        name: value for name, value in broken.items() if name not in fields or not same(value, fields[name])
    }


_BREAKS = [
    "bool id",
    "negative id",
    "float id",
    "huge id",
    "enum id",
    "int subclass id",
    "int log prob",
    "nan log prob",
    "int created_at",
    "infinite created_at",
    "nan extra",
    "nan output item",
    "empty call id",
    "newline call id",
    "bad rollout id",
    "tuple ids",
    "datetime extra",
    "int rollout id",
]


def _built_then_changed(fields: dict[str, Any], how: str | None) -> TokenEntry:
    """A validated entry, then changed in place the way a caller can change a built entry."""
    entry = TokenEntry.model_validate(copy.deepcopy(fields))
    if how is not None:
        for name, value in _break(fields, how).items():
            if name in TokenEntry.model_fields:
                entry.__dict__[name] = value
            else:
                (entry.__pydantic_extra__ or {})[name] = value
    return entry


def _check_sink_paths_agree(entry: TokenEntry, writer: str, *, changed: bool) -> None:
    fast = outcome(lambda: accept_put(copy.deepcopy(entry), writer))
    reference = outcome(lambda: reference_put(copy.deepcopy(entry), writer))
    assert fast[0] == reference[0], (fast, reference)
    if fast[0] == "refused":
        assert fast[1] == reference[1]
        return
    fast_event, reference_event = fast[1], reference[1]
    assert same(_model_fields(fast_event), _model_fields(reference_event))
    assert fast_event.__pydantic_fields_set__ == reference_event.__pydantic_fields_set__
    assert same(fast_event.entry, reference_event.entry)
    # An entry changed after validation may hold values pydantic's dump renders differently (an int log
    # prob as 0.0); its line is then the one the validated door writes, not the dump's.
    line = reference_event.entry_line if changed else reference_line(reference_event.entry)
    assert fast_event.entry_line == line
    assert fast_event.payload_digest == hashlib.sha256(line).hexdigest()


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(entries(), st.sampled_from(["", "sink-1"]))
def test_a_sinks_put_gives_the_reference_line_digest_and_event(fields: dict[str, Any], writer: str) -> None:
    _check_sink_paths_agree(_built_then_changed(fields, None), writer, changed=False)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(entries(), st.sampled_from(_BREAKS))
def test_a_sinks_put_of_a_changed_entry_is_refused_or_accepted_as_the_reference_does(
    fields: dict[str, Any], how: str
) -> None:
    _check_sink_paths_agree(_built_then_changed(fields, how), "w", changed=True)


@settings(max_examples=50, suppress_health_check=[HealthCheck.too_slow])
@given(entries())
def test_a_mapping_or_a_gym_like_entry_takes_the_reference_door_with_the_same_result(
    fields: dict[str, Any],
) -> None:
    fast = outcome(lambda: accept_put(copy.deepcopy(fields)))
    reference = outcome(lambda: reference_put(copy.deepcopy(fields), ""))
    assert fast[0] == reference[0]
    if fast[0] == "refused":
        assert fast[1] == reference[1]
        return
    assert same(_model_fields(fast[1]), _model_fields(reference[1]))
    assert fast[1].entry_line == reference_line(reference[1].entry)


def _wire_mapping(fields: dict[str, Any]) -> dict[str, Any]:
    """The decoded JSON of a put as a reader gets it: the entry's JSON dump inside the event's."""
    entry = orjson.loads(reference_line(TokenEntry.model_validate(copy.deepcopy(fields))))
    return {
        "entry": entry,
        "rollout_id": entry["rollout_id"],
        "schema_version": 1,
        "type": "put",
        "writer": "w",
    }


def _change_raw(raw: dict[str, Any], how: str) -> dict[str, Any]:
    changed = copy.deepcopy(raw)
    entry = changed["entry"]
    if how in (
        "int log prob",
        "nan log prob",
        "int created_at",
        "nan extra",
        "nan output item",
        "empty call id",
    ):
        entry.update(_break(entry, how))
    elif how == "no writer":
        del changed["writer"]
    elif how == "no schema":
        del changed["schema_version"]
    elif how == "old event schema":
        changed["schema_version"] = 0
    elif how == "newer event schema":
        changed["schema_version"] = 2
    elif how == "newer entry schema":
        entry["schema_version"] = 2
    elif how == "old entry schema":
        entry["schema_version"] = 0
    elif how == "unknown event field":
        changed["extra"] = 1
    elif how == "other rollout":
        entry["rollout_id"] = entry["rollout_id"] + "x"
    elif how == "bad resolution":
        entry["parent_resolution"] = "maybe"
    elif how == "index outside items":
        entry["token_item_index"] = len(entry["output_items"])
    elif how == "unequal lengths":
        entry["generation_log_probs"] = [*entry["generation_log_probs"], -1.0]
    elif how == "int writer":
        changed["writer"] = 5
    elif how == "float count":
        entry["cum_len"] = 3.0
    elif how == "string bool":
        entry["prefix_supplied"] = "true"
    elif how == "missing call id":
        del entry["model_call_id"]
    elif how == "delta without parent":
        entry["prompt_is_delta"] = True
        entry["parent_resolution"] = None
        entry["parent_call_id"] = None
    elif how == "root with parent":
        entry["parent_resolution"] = "root"
        entry["parent_call_id"] = "p"
    return changed


_RAW_CHANGES = [
    None,
    "int log prob",
    "nan log prob",
    "int created_at",
    "nan extra",
    "nan output item",
    "empty call id",
    "no writer",
    "no schema",
    "old event schema",
    "newer event schema",
    "newer entry schema",
    "old entry schema",
    "unknown event field",
    "other rollout",
    "bad resolution",
    "index outside items",
    "unequal lengths",
    "int writer",
    "float count",
    "string bool",
    "missing call id",
    "delta without parent",
    "root with parent",
]


@settings(max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(entries(), st.sampled_from(_RAW_CHANGES))
def test_a_readers_put_is_built_or_refused_exactly_as_the_validated_event(
    fields: dict[str, Any], how: str | None
) -> None:
    raw = _wire_mapping(fields)
    if how is not None:
        raw = _change_raw(raw, how)
    fast = outcome(lambda: accept_put_or_event(copy.deepcopy(raw), token_ids_checked=True))
    reference = outcome(lambda: accept_event(copy.deepcopy(raw), token_ids_checked=True))
    assert fast[0] == reference[0], (fast, reference)
    if fast[0] == "refused":
        assert fast[1] == reference[1]
        return
    fast_event: Event = fast[1]
    reference_event: Event = reference[1]
    assert isinstance(fast_event, PutEvent) and isinstance(reference_event, PutEvent)
    assert same(fast_event, reference_event)
    assert fast_event.entry_line == reference_line(reference_event.entry)
    assert fast_event.payload_digest == reference_event.payload_digest


def test_a_readers_put_with_unchecked_ids_is_left_to_the_reference_door() -> None:
    raw = _wire_mapping(
        {
            "rollout_id": "r",
            "model_call_id": "c",
            "prompt_token_ids": [1],
            "generation_token_ids": [2],
            "generation_log_probs": [-0.5],
        }
    )
    raw["entry"]["prompt_token_ids"] = [True]
    with pytest.raises(InvalidInputError) as fast:
        accept_put_or_event(copy.deepcopy(raw), token_ids_checked=False)
    with pytest.raises(InvalidInputError) as reference:
        accept_event(copy.deepcopy(raw), token_ids_checked=False)
    assert str(fast.value) == str(reference.value)


def _plain_fields() -> dict[str, Any]:
    return {
        "rollout_id": "r",
        "model_call_id": "c",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4],
        "generation_log_probs": [-0.5],
        "parent_resolution": "root",
    }


def test_a_sinks_valid_put_is_encoded_once_while_it_is_checked() -> None:
    event = accept_put(TokenEntry.model_validate(_plain_fields()), "w")
    assert "entry_line" in event.__dict__ and "payload_digest" in event.__dict__
    assert event.entry_line == reference_line(event.entry)


def test_a_readers_valid_put_is_built_without_validating_its_arrays_again() -> None:
    raw = _wire_mapping(_plain_fields())
    log_probs = raw["entry"]["generation_log_probs"]
    event = accept_put_or_event(raw, token_ids_checked=True)
    assert isinstance(event, PutEvent)
    assert event.entry.generation_log_probs is log_probs

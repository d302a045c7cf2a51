"""Reading an event back: canonical bytes round-trip, and anything else fails with a typed error that says why.

The materializer dead-letters on these errors instead of stopping, so each must be an ``EventDecodeError``
(or a ``NewerSchemaError`` telling the operator to upgrade the reader), never a bare pydantic error.
"""

from __future__ import annotations

import orjson
import pytest
from factories import make_entry

from tokcap.errors import EventDecodeError, NewerSchemaError
from tokcap.log.events import (
    EVENT_SCHEMA_VERSION,
    CancelEvent,
    DeleteEvent,
    DropEvent,
    Event,
    FreezeEvent,
    IncompleteEvent,
    IntentEvent,
    PutEvent,
    RetireEvent,
    decode_event,
    encode_event,
)
from tokcap.log.records import TOKEN_ENTRY_RECORD_SCHEMA_VERSION, entry_digest

_EVERY_KIND: list[Event] = [
    IntentEvent(rollout_id="r1", writer="w", model_call_id="c1"),
    CancelEvent(rollout_id="r1", writer="w", model_call_id="c1"),
    PutEvent(rollout_id="r1", writer="w", entry=make_entry("r1", "c1")),
    IncompleteEvent(rollout_id="r1", writer="w", model_call_id="c2", reason="lost"),
    FreezeEvent(rollout_id="r1", writer="w"),
    DropEvent(rollout_id="r1", writer="w", snapshot_id="s", version=3),
    RetireEvent(rollout_id="r1", writer="w"),
    DeleteEvent(rollout_id="r1", writer="w"),
]


@pytest.mark.parametrize("event", _EVERY_KIND, ids=lambda event: str(event.type))
def test_every_event_kind_round_trips_through_its_canonical_bytes(event: Event) -> None:
    data = encode_event(event)
    assert decode_event(data) == event
    assert encode_event(decode_event(data)) == data


def _raw(event: Event) -> dict[str, object]:
    raw: dict[str, object] = orjson.loads(encode_event(event))
    return raw


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (
            orjson.dumps({**_raw(FreezeEvent(rollout_id="r1")), "type": "explode"}),
            "unknown event type 'explode'",
        ),
        (
            orjson.dumps({**_raw(DropEvent(rollout_id="r1", snapshot_id="s", version=1)), "version": "1"}),
            "invalid drop",
        ),
    ],
)
def test_bytes_that_are_not_an_event_fail_with_a_decode_error_saying_why(data: bytes, fragment: str) -> None:
    with pytest.raises(EventDecodeError, match=fragment):
        decode_event(data)


def test_an_event_or_record_from_a_newer_writer_asks_for_an_upgrade_instead_of_guessing() -> None:
    newer_event = {**_raw(FreezeEvent(rollout_id="r1")), "schema_version": EVENT_SCHEMA_VERSION + 1}
    with pytest.raises(NewerSchemaError, match="upgrade tokcap on the reader"):
        decode_event(orjson.dumps(newer_event))
    put = _raw(PutEvent(rollout_id="r1", entry=make_entry("r1", "c1")))
    put["entry"] = {**put["entry"], "schema_version": TOKEN_ENTRY_RECORD_SCHEMA_VERSION + 1}  # type: ignore[dict-item]
    with pytest.raises(NewerSchemaError, match="record schema_version"):
        decode_event(orjson.dumps(put))


def test_a_put_keyed_by_one_rollout_cannot_carry_another_rollouts_entry() -> None:
    smuggled = _raw(PutEvent(rollout_id="r1", entry=make_entry("r1", "c1")))
    smuggled["rollout_id"] = "r2"
    with pytest.raises(EventDecodeError, match="put event for rollout 'r2' carries an entry of rollout 'r1'"):
        decode_event(orjson.dumps(smuggled))


def test_a_puts_line_and_digest_are_its_entrys_and_are_no_fields_of_the_event() -> None:
    """Kept on the event once computed, they change neither its dump, its equality nor its encoding."""
    entry = make_entry("r", "c", prompt=range(3000))
    read, fresh = PutEvent(rollout_id="r", entry=entry), PutEvent(rollout_id="r", entry=entry)
    assert read.entry_line == entry.canonical_json()
    assert read.payload_digest == entry.payload_digest() == entry_digest(entry.canonical_json())
    assert read == fresh
    assert read.model_dump() == fresh.model_dump()
    assert encode_event(read) == encode_event(fresh)

"""The Kafka message encoding is lossless, compact for token arrays, and chunks large values."""

from __future__ import annotations

import hashlib
import struct
from array import array

import orjson
import pytest
from staging_calls import commit_for, conversation, staged_call

from tokcap.errors import EventDecodeError, NewerSchemaError, RecordValidationError
from tokcap.ledger import ledger_event
from tokcap.log.events import (
    EVENT_SCHEMA_VERSION,
    Event,
    FreezeEvent,
    LedgerFailureEvent,
    PutEvent,
    StagedBlob,
    StageEvent,
    encode_event,
)
from tokcap.log.records import TokenEntry
from transports.kafka.wire.codec import (
    HEADER_ENCODING,
    decode_event_value,
    decode_message,
    encode_event_messages,
    encode_event_value,
    headers_to_dict,
    read_chunk_header,
)


def put_event(ids: list[int], log_probs: list[float] | None = None, **extra: object) -> PutEvent:
    generation = ids[: len(log_probs)] if log_probs is not None else ids[:3]
    entry = TokenEntry(
        rollout_id="r1",
        model_call_id="c1",
        prompt_token_ids=ids,
        generation_token_ids=generation,
        generation_log_probs=log_probs if log_probs is not None else [-0.1] * len(generation),
        created_at=1.5,
        **extra,
    )
    return PutEvent(rollout_id="r1", writer="w", entry=entry)


def roundtrip(event: PutEvent | FreezeEvent) -> bytes:
    encoding, value = encode_event_value(event)
    decoded = decode_event_value(value, {HEADER_ENCODING: encoding})
    assert decoded == event
    return value


def test_a_packed_put_decodes_to_the_same_canonical_entry_with_full_float64_precision() -> None:
    probs = [-1e-308, -5e-324, -0.0, -1.0 / 3.0]
    event = put_event([0, 1, 2**31 - 1, 2**31 - 2], probs, tool="x", nested={"b": [1, 2.5]})
    encoding, value = encode_event_value(event)
    assert encoding == "packed"
    decoded = decode_event_value(value, {HEADER_ENCODING: encoding})
    assert isinstance(decoded, PutEvent)
    assert decoded.entry.canonical_json() == event.entry.canonical_json()


def test_ids_beyond_32_bits_are_packed_as_64_bit_and_beyond_64_bits_are_refused() -> None:
    narrow = roundtrip(put_event([1, 2, 3]))
    wide = roundtrip(put_event([2**40, 2**62, 3]))
    assert len(wide) - len(narrow) == 6 * 4
    with pytest.raises(RecordValidationError):
        encode_event_value(put_event([2**70, 1, 2]))


def test_packed_token_arrays_are_much_smaller_than_their_json() -> None:
    event = put_event(list(range(100_000, 200_000)))
    _, packed = encode_event_value(event)
    assert len(packed) * 10 < len(encode_event(event)) * 6


def test_events_other_than_put_travel_as_the_canonical_event_json() -> None:
    event = FreezeEvent(rollout_id="r1", writer="w")
    assert encode_event_value(event) == ("json", encode_event(event))


def test_a_large_value_is_split_into_chunks_whose_headers_describe_the_whole() -> None:
    event = put_event(list(range(10_000)))
    groups = iter(["session:0"])
    messages = encode_event_messages(event, chunk_bytes=4096, next_chunk_group=lambda: next(groups))
    assert len(messages) > 2
    whole = b"".join(message.value for message in messages)
    assert whole == encode_event_value(event)[1]
    headers = [headers_to_dict(message.headers) for message in messages]
    chunks = [read_chunk_header(h) for h in headers]
    assert [(c.group, c.index, c.count) for c in chunks if c] == [
        ("session:0", i, len(messages)) for i in range(len(messages))
    ]
    assert {c.digest for c in chunks if c} == {hashlib.sha256(whole).hexdigest()}
    assert all(message.key == b"r1" for message in messages)
    assert headers[0]["tokcap.type"] == "put" and headers[0]["tokcap.writer"] == "w"


def test_a_small_value_is_one_message_without_chunk_headers() -> None:
    (message,) = encode_event_messages(put_event([1, 2, 3]), next_chunk_group=lambda: "unused")
    assert read_chunk_header(headers_to_dict(message.headers)) is None


def test_partial_or_inconsistent_chunk_headers_are_undecodable() -> None:
    with pytest.raises(EventDecodeError):
        read_chunk_header({"tokcap.chunk.group": "g"})
    with pytest.raises(EventDecodeError):
        read_chunk_header(
            {
                "tokcap.chunk.group": "g",
                "tokcap.chunk.index": "3",
                "tokcap.chunk.count": "3",
                "tokcap.chunk.sha256": "x",
            }
        )


def test_a_newer_schema_header_or_body_is_refused_as_newer() -> None:
    body = orjson.dumps({"schema_version": EVENT_SCHEMA_VERSION + 1, "type": "freeze", "rollout_id": "r"})
    with pytest.raises(NewerSchemaError):
        decode_event_value(b"{}", {"tokcap.schema_version": str(EVENT_SCHEMA_VERSION + 1)})
    with pytest.raises(NewerSchemaError):
        decode_event_value(body, {})


def test_truncated_or_foreign_packed_values_are_undecodable() -> None:
    _, value = encode_event_value(put_event(list(range(50))))
    for broken in (value[:-4], value + b"\x00", b"XXXX" + value[4:], b"TKP1"):
        with pytest.raises(EventDecodeError):
            decode_event_value(broken, {HEADER_ENCODING: "packed"})
    with pytest.raises(EventDecodeError):
        decode_event_value(value, {HEADER_ENCODING: "msgpack"})


def test_extra_values_orjson_would_render_differently_still_decode_to_the_same_canonical_entry() -> None:
    import dataclasses
    import datetime

    @dataclasses.dataclass
    class Point:
        x: int

    event = put_event(
        [5, 6, 7], when=datetime.datetime(2024, 1, 2, 3, 4, 5), point=Point(1), day=datetime.date(2024, 1, 1)
    )
    encoding, value = encode_event_value(event)
    decoded = decode_event_value(value, {HEADER_ENCODING: encoding})
    assert isinstance(decoded, PutEvent)
    assert decoded.entry.canonical_json() == event.entry.canonical_json()


def _json_put(event: PutEvent, **entry_fields: object) -> bytes:
    raw = orjson.loads(encode_event(event))
    raw["entry"].update(entry_fields)
    return orjson.dumps(raw)


def _packed_with(event: PutEvent, field: str, dtype: str, data: bytes) -> bytes:
    """A packed put whose array ``field`` is replaced by ``data`` described as ``dtype`` (a hand-made message)."""
    _, value = encode_event_value(event)
    (length,) = struct.unpack_from("<I", value, 4)
    head = orjson.loads(value[8 : 8 + length])
    arrays, cursor, blobs = head["arrays"], 8 + length, []
    for descriptor in arrays:
        size = descriptor["count"] * (4 if descriptor["dtype"] == "<i4" else 8)
        blob = value[cursor : cursor + size]
        cursor += size
        if descriptor["field"] == field:
            width = 4 if dtype == "<i4" else 8
            descriptor.update(dtype=dtype, count=len(data) // width)
            blob = data
        blobs.append(blob)
    new_head = orjson.dumps(head, option=orjson.OPT_SORT_KEYS)
    return b"".join([b"TKP1", struct.pack("<I", len(new_head)), new_head, *blobs])


_CODES = {"<i4": "i", "<i8": "q", "<f8": "d"}


@pytest.mark.parametrize(
    ("field", "dtype", "values", "why"),
    [
        ("prompt_token_ids", "<i4", [5, -7, 9], "negative token id"),
        ("prompt_token_ids", "<i8", [5, -(2**40), 9], "negative token id"),
        ("prompt_token_ids", "<f8", [5.0, 7.0, 9.0], "packed as <f8"),
        ("generation_token_ids", "<i4", [-1, 8], "negative token id"),
    ],
)
def test_a_packed_id_array_a_sink_could_not_have_sent_is_refused_naming_its_field(
    field: str, dtype: str, values: list[float], why: str
) -> None:
    value = _packed_with(
        put_event([1, 2, 3], [-0.5, -0.25]), field, dtype, array(_CODES[dtype], values).tobytes()
    )
    with pytest.raises(EventDecodeError, match=rf"input rules: .*{field} .*{why}"):
        decode_event_value(value, {HEADER_ENCODING: "packed"})


def test_the_widest_ids_a_sink_sends_still_decode_unchanged() -> None:
    ids = [0, 2**31 - 1, 2**63 - 1, 2**63, 2**64 - 1]
    decoded = decode_event_value(encode_event_value(put_event(ids))[1], {HEADER_ENCODING: "packed"})
    assert isinstance(decoded, PutEvent) and decoded.entry.prompt_token_ids == ids


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt_token_ids": [5, -7, 9]}, "prompt_token_ids holds token id -7"),
        ({"generation_token_ids": [True, 8]}, "generation_token_ids must hold ints only"),
        ({"prompt_token_ids": [1.0, 2]}, "prompt_token_ids must hold ints only"),
        ({"model_call_id": "a\nb"}, "model_call_id .* control character"),
        ({"model_call_id": "z" * 5000}, "model_call_id is 5000 characters"),
    ],
)
def test_a_json_put_a_sink_would_refuse_is_refused_naming_its_field(
    fields: dict[str, object], named: str
) -> None:
    value = _json_put(put_event([1, 2, 3]), **fields)
    with pytest.raises(EventDecodeError, match=rf"input rules: .*{named}"):
        decode_event_value(value, {HEADER_ENCODING: "json"})


@pytest.mark.parametrize("call_id", ["a\nb", "c9\r\x00c1", "z" * 5000])
@pytest.mark.parametrize("kind", ["intent", "cancel", "incomplete"])
def test_an_event_whose_call_id_a_side_file_line_could_not_hold_is_refused(kind: str, call_id: str) -> None:
    raw = {"schema_version": 1, "type": kind, "rollout_id": "r1", "writer": "w", "model_call_id": call_id}
    with pytest.raises(EventDecodeError, match=r"input rules: .*model_call_id"):
        decode_event_value(orjson.dumps(raw), {})


@pytest.mark.parametrize(
    "event",
    [
        LedgerFailureEvent(rollout_id="r1", model_call_id="c1", reason="worker_capture_failed"),
        ledger_event(commit_for(conversation("r1", 1)[0])),
    ],
)
def test_a_ledger_event_crosses_the_wire_unchanged(event: Event) -> None:
    [message] = encode_event_messages(event, next_chunk_group=lambda: "s:0")
    assert decode_message(message.key, message.value, headers_to_dict(message.headers)) == event


def _stage_with_blobs(blobs: dict[str, bytes], extras: bytes | None = None) -> StageEvent:
    def ref(data: bytes) -> StagedBlob:
        return StagedBlob(sha256=hashlib.sha256(data).hexdigest(), size=len(data))

    event = StageEvent(
        rollout_id="r1",
        model_call_id="c1",
        staging_key="r1/c1",
        row=staged_call("r1", "c1", [1], [2]).model_dump(mode="json", exclude={"extras"}),
        extras=None if extras is None else ref(extras),
        attachments={name: ref(data) for name, data in blobs.items()},
    )
    carried = {
        ref(data).sha256: data for data in [*blobs.values(), *([extras] if extras is not None else [])]
    }
    return event.with_blob_bytes(carried)


def test_a_stage_event_crosses_the_wire_in_chunks_with_every_blob_byte() -> None:
    image = bytes(range(256)) * 12_000
    event = _stage_with_blobs({"image": image, "empty": b""}, extras=b'{"routed_experts":[1,2]}')
    messages = encode_event_messages(event, chunk_bytes=1_000_000, next_chunk_group=lambda: "s:0")
    assert len(messages) == 4
    whole = b"".join(message.value for message in messages)
    decoded = decode_message(b"r1", whole, headers_to_dict(messages[0].headers))
    assert decoded.model_dump() == event.model_dump()
    assert isinstance(decoded, StageEvent)
    assert decoded.blob_bytes == event.blob_bytes


def test_a_stage_event_whose_blob_does_not_match_its_hash_is_refused() -> None:
    event = _stage_with_blobs({"image": b"pixels"})
    _, value = encode_event_value(event)
    damaged = value[:-1] + b"X"
    with pytest.raises(EventDecodeError, match="does not match the SHA-256"):
        decode_message(b"r1", damaged, {HEADER_ENCODING: "staged"})
    with pytest.raises(EventDecodeError, match="truncated inside blob"):
        decode_message(b"r1", value[:-1], {HEADER_ENCODING: "staged"})


def test_a_stage_event_without_its_blobs_is_refused() -> None:
    event = _stage_with_blobs({"image": b"pixels"})
    with pytest.raises(EventDecodeError, match="'staged' encoding"):
        decode_message(b"r1", encode_event(event), {HEADER_ENCODING: "json"})
    with pytest.raises(Exception, match="does not carry its bytes"):
        encode_event_value(StageEvent.model_validate(event.model_dump()))

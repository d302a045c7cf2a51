"""Events as Kafka messages, and back: the one way from an event to its messages and from a message to its event.

An event's value has one of four encodings, each in a module of its own:

- ``json``: the canonical ``tokcap.log.events`` encoding (every event but ``put`` and ``stage``).
- ``packed``: a ``put`` event with its token arrays packed as binary (``packed_arrays``).
- ``staged``: a ``stage`` event and the bytes of the blobs it names (``staged_values``).
- ``delta``: a ``put`` sent as its parent's link and its prompt suffix (``deltas``); only a reader holding
  the parent restores it (``delta_parents``), so ``decode_event_value`` refuses it.
- ``staged-ref``: a ``stage`` event whose ``staged`` value lies on the topic's staged-payload topic; the value
  says where (``staged_payloads``), and only the inbound router, which can read that topic, decodes it.

The key, the headers and a message as read are ``messages``; the names are importable from here too.

Every event decoded here passes the sinks' input rules (``tokcap.log.input_rules.accept_event``) before anyone
gets it: what a sink would have refused to send is refused the same way when it is read, as an
``EventDecodeError`` whose text names the field, which the router dead-letters (``input_refusals``).

A value larger than the chunk size is split into chunk messages that carry
``(group id, index, count, sha256 of the whole value)`` headers; the inbound router reassembles them.
No value larger than the topic's ``max_event_bytes`` (``topic_limits``) is sent: the router refuses to
reassemble one, so a sink that sent it would have reported ok for an event no reader applies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import orjson

from tokcap.errors import ConfigError, EventDecodeError, EventTooLargeError, NewerSchemaError
from tokcap.log.events import EVENT_SCHEMA_VERSION, Event, PutEvent, StageEvent, encode_event
from tokcap.log.hashing import sha256_hex
from transports.kafka.wire.deltas import (
    WIRE_DELTA_SCHEMA_VERSION,
    ParentLink,
    WireDelta,
    decode_wire_delta,
    encode_delta_message,
    is_wire_delta,
)
from transports.kafka.wire.input_refusals import accepted
from transports.kafka.wire.messages import (
    ENCODING_DELTA,
    ENCODING_JSON,
    ENCODING_PACKED,
    ENCODING_STAGED,
    ENCODING_STAGED_REFERENCE,
    HEADER_CHUNK_COUNT,
    HEADER_CHUNK_DIGEST,
    HEADER_CHUNK_GROUP,
    HEADER_CHUNK_INDEX,
    HEADER_ENCODING,
    HEADER_SCHEMA,
    HEADER_TYPE,
    HEADER_WRITER,
    ChunkHeader,
    ConsumedMessage,
    LogMessage,
    OutgoingMessage,
    header_pairs,
    headers_to_dict,
    read_chunk_header,
    rollout_of_key,
    type_header,
)
from transports.kafka.wire.packed_arrays import pack_put, read_packed_head, unpack_put
from transports.kafka.wire.staged_values import pack_stage, unpack_stage
from transports.kafka.wire.topic_limits import TOPIC_DEFAULTS, TopicLimits

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ENCODING_DELTA",
    "ENCODING_JSON",
    "ENCODING_PACKED",
    "ENCODING_STAGED",
    "ENCODING_STAGED_REFERENCE",
    "HEADER_CHUNK_COUNT",
    "HEADER_CHUNK_DIGEST",
    "HEADER_CHUNK_GROUP",
    "HEADER_CHUNK_INDEX",
    "HEADER_ENCODING",
    "HEADER_SCHEMA",
    "HEADER_TYPE",
    "HEADER_WRITER",
    "WIRE_DELTA_SCHEMA_VERSION",
    "ChunkHeader",
    "ConsumedMessage",
    "LogMessage",
    "OutgoingMessage",
    "ParentLink",
    "WireDelta",
    "check_event_size",
    "check_size_settings",
    "decode_event_value",
    "decode_message",
    "decode_wire_delta",
    "encode_delta_message",
    "encode_event_messages",
    "encode_event_value",
    "header_pairs",
    "headers_to_dict",
    "is_wire_delta",
    "read_chunk_header",
    "read_packed_head",
    "rollout_of_key",
    "type_header",
]

DEFAULT_CHUNK_BYTES = 900_000
"""Largest value sent in one message; below the producer's and broker's default 1 MB limits."""


def encode_event_value(event: Event) -> tuple[str, bytes]:
    """The value bytes of an event and the name of their encoding."""
    if isinstance(event, PutEvent):
        return ENCODING_PACKED, pack_put(event)
    if isinstance(event, StageEvent):
        return ENCODING_STAGED, pack_stage(event)
    return ENCODING_JSON, encode_event(event)


def check_size_settings(chunk_bytes: int, max_event_bytes: int | None) -> None:
    """Refuse a sink's size settings that would send messages the broker or the readers refuse."""
    if chunk_bytes < 1024:
        raise ConfigError(f"chunk_bytes must be at least 1024, got {chunk_bytes}")
    if max_event_bytes is not None and max_event_bytes < chunk_bytes:
        raise ConfigError(
            f"max_event_bytes ({max_event_bytes}) must be at least chunk_bytes ({chunk_bytes}): "
            "an event that fits one message must also fit the event limit; lower chunk_bytes"
        )


def check_event_size(event: Event, size: int, max_event_bytes: int) -> None:
    """Refuse an event value larger than the readers reassemble, before any of it is sent."""
    if size <= max_event_bytes:
        return
    call_id = getattr(event, "model_call_id", None)
    if isinstance(event, PutEvent):
        call_id = event.entry.model_call_id
    what = f"{event.type.value} event of rollout {event.rollout_id!r}"
    if call_id:
        what += f" call {call_id!r}"
    raise EventTooLargeError(
        f"{what} is {size:,} bytes encoded, over the topic's maximum event size of {max_event_bytes:,} bytes "
        "(max_event_bytes); nothing was sent. Keep media of that size out of the capture (stage a reference "
        "to it), or run on a topic made with a larger limit (`tokcap topic create --max-event-bytes N`, "
        "docs/operations.md): every sink and reader uses the limits the topic was made with",
        rollout_id=event.rollout_id,
        model_call_id=call_id or None,
    )


def encode_event_messages(
    event: Event,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    limits: TopicLimits = TOPIC_DEFAULTS,
    next_chunk_group: Callable[[], str],
) -> list[OutgoingMessage]:
    """The message, or chunk messages, that carry one event.

    ``next_chunk_group`` names a chunk group ``<session>:<sequence>``; it is called only when chunking.
    An event whose value is larger than the topic's ``limits.max_event_bytes`` raises ``EventTooLargeError``.
    A writer passes the limits of the topic it writes (``limits_record``); messages that are never chunked
    (commands, ledger rows) are far below any limit a topic can usefully have.
    """
    encoding, value = encode_event_value(event)
    check_event_size(event, len(value), limits.max_event_bytes)
    key = event.rollout_id.encode()
    base_headers = [
        (HEADER_TYPE, event.type.value.encode()),
        (HEADER_SCHEMA, str(event.schema_version).encode()),
        (HEADER_WRITER, event.writer.encode()),
        (HEADER_ENCODING, encoding.encode()),
    ]
    if len(value) <= chunk_bytes:
        return [OutgoingMessage(key, value, base_headers)]
    group = next_chunk_group()
    digest = sha256_hex(value)
    count = -(-len(value) // chunk_bytes)
    return [
        OutgoingMessage(
            key,
            value[index * chunk_bytes : (index + 1) * chunk_bytes],
            [
                *base_headers,
                (HEADER_CHUNK_GROUP, group.encode()),
                (HEADER_CHUNK_INDEX, str(index).encode()),
                (HEADER_CHUNK_COUNT, str(count).encode()),
                (HEADER_CHUNK_DIGEST, digest.encode()),
            ],
        )
        for index in range(count)
    ]


def decode_event_value(value: bytes, headers: Mapping[str, str]) -> Event:
    """Decode a whole (or reassembled) value; newer schemas raise ``NewerSchemaError``."""
    schema = headers.get(HEADER_SCHEMA)
    delta = headers.get(HEADER_ENCODING) == ENCODING_DELTA and schema == str(WIRE_DELTA_SCHEMA_VERSION)
    if not delta and schema is not None and schema.isdigit() and int(schema) > EVENT_SCHEMA_VERSION:
        raise NewerSchemaError(
            f"event schema_version {schema} is newer than {EVENT_SCHEMA_VERSION}; upgrade tokcap on the reader"
        )
    encoding = headers.get(HEADER_ENCODING, ENCODING_JSON)
    if encoding == ENCODING_DELTA:
        raise EventDecodeError(
            "a wire delta (encoding 'delta') is decoded with its parent message: read it through the inbound router"
        )
    if encoding == ENCODING_PACKED:
        event = accepted(unpack_put(value), token_ids_checked=True)
        if not isinstance(event, PutEvent):
            raise EventDecodeError(f"a packed value must be a put event, got {event.type.value}")
        return event
    if encoding == ENCODING_STAGED:
        return unpack_stage(value)
    if encoding == ENCODING_STAGED_REFERENCE:
        raise EventDecodeError(
            "a staged reference (encoding 'staged-ref') is decoded with its payload from the staged-payload "
            "topic: read it through the inbound router"
        )
    if encoding != ENCODING_JSON:
        raise EventDecodeError(f"unknown value encoding {encoding!r}")
    try:
        raw = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise EventDecodeError(f"event is not valid JSON: {exc}") from exc
    event = accepted(raw, token_ids_checked=False)
    if isinstance(event, StageEvent):
        raise EventDecodeError("a stage event travels in the 'staged' encoding, which carries its blobs")
    return event


def decode_message(key: bytes | None, value: bytes | None, headers: Mapping[str, str]) -> Event:
    """The event a whole (or reassembled) message carries: the one way from a message to an event.

    The event must name the rollout its key names, or it would be applied to a partition that does not
    order that rollout. Raise ``EventDecodeError``, or ``NewerSchemaError`` for a newer schema, whose text
    is the reason to dead-letter the message with.
    """
    if value is None:
        raise EventDecodeError("message has no value")
    try:
        event = decode_event_value(value, headers)
    except NewerSchemaError as exc:
        raise NewerSchemaError(f"newer schema: {exc}") from exc
    except EventDecodeError as exc:
        raise EventDecodeError(f"undecodable event: {exc}") from exc
    if key is None or key != event.rollout_id.encode():
        raise EventDecodeError(f"key {key!r} does not match the event's rollout {event.rollout_id!r}")
    if rollout_of_key(key) is None:
        raise EventDecodeError(f"invalid rollout id {event.rollout_id!r}")
    return event

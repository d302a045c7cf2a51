"""Staged calls whose bytes lie on the staged-payload topic, and the small references that name them.

A topic made with a staged-payload topic (``topic_limits``) carries each staged call in two parts. The
``staged`` value (``codec``: the stage's row, then its extras and attachments) goes to the payload topic in
pieces of at most ``chunk_bytes``, keyed by the rollout id like the stage. Once the broker acknowledged every
piece, the sink sends the reference: a ``stage`` message on the run topic in the ``staged-ref`` encoding that
names the pieces' partition and offsets, the value's size and SHA-256, and the stage's key. The reference's
position is the stage's log position, so the stage keeps its place among its rollout's events.

Why two topics: a reader that needs ledger rows and commands alone (a ledger, the lineage resolver) passes over
``stage`` messages by their type header, but Kafka cannot fetch headers without values. With the bytes apart,
such a reader fetches a few hundred bytes per staged call, whatever the call holds.

Restoring a reference (``StagedPayloadRestorer``, which the inbound router holds): read each piece at its
position, check that it is that piece of that value (its type, key, digest, index and count), join the pieces,
check the size and SHA-256, decode the ``staged`` value and check that it is the stage the reference names.
A mismatch, a piece the log no longer holds, a reference to a topic other than the one the run topic's record
names, or a value over ``max_event_bytes`` makes the stage undecodable: it is dead-lettered and its rollout
masked, as any corrupt stage. A broker that does not answer stops the reader instead (``TransportError``):
a slow broker must never look like a missing payload.

A piece is sent only before its reference, so a reference never names a piece the broker did not acknowledge.
A piece whose reference never came (the sink died between the two) is never read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from tokcap.errors import EventDecodeError, TransportError
from tokcap.log.events import StageEvent
from tokcap.log.hashing import sha256_hex
from transports.kafka.wire.codec import (
    ENCODING_STAGED,
    ENCODING_STAGED_REFERENCE,
    HEADER_ENCODING,
    HEADER_SCHEMA,
    HEADER_TYPE,
    HEADER_WRITER,
    LogMessage,
    OutgoingMessage,
    check_event_size,
    decode_message,
    encode_event_value,
    headers_to_dict,
)
from transports.kafka.wire.topic_limits import TopicLimits

__all__ = [
    "HEADER_PAYLOAD_COUNT",
    "HEADER_PAYLOAD_DIGEST",
    "HEADER_PAYLOAD_INDEX",
    "PAYLOAD_SCHEMA",
    "PAYLOAD_TYPE",
    "PositionReader",
    "StagedPayload",
    "StagedPayloadRestorer",
    "StagedReference",
    "decode_reference",
    "encode_staged_payload",
    "encode_staged_reference",
    "is_staged_reference",
]

PAYLOAD_TYPE = "staged-payload"
"""The ``tokcap.type`` header of a piece on the staged-payload topic."""

PAYLOAD_SCHEMA = 1
"""The ``tokcap.schema_version`` of a piece and of a reference's value."""

HEADER_PAYLOAD_DIGEST = "tokcap.payload.sha256"
HEADER_PAYLOAD_INDEX = "tokcap.payload.index"
HEADER_PAYLOAD_COUNT = "tokcap.payload.count"

_REFERENCE_FIELDS = frozenset(
    {
        "model_call_id",
        "offsets",
        "partition",
        "rollout_id",
        "schema",
        "sha256",
        "size",
        "staging_key",
        "topic",
    }
)
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class StagedPayload:
    """A stage's ``staged`` value and the pieces that carry it to the payload topic."""

    value_size: int
    sha256: str
    pieces: list[OutgoingMessage]


@dataclass(frozen=True)
class StagedReference:
    """Where a stage's ``staged`` value lies, and which stage it is."""

    rollout_id: str
    staging_key: str
    model_call_id: str
    topic: str
    partition: int
    offsets: tuple[int, ...]
    size: int
    sha256: str


def is_staged_reference(headers: Mapping[str, str]) -> bool:
    """Whether a message's (decoded) headers name it a staged reference."""
    return headers.get(HEADER_ENCODING) == ENCODING_STAGED_REFERENCE


def encode_staged_payload(event: StageEvent, *, chunk_bytes: int, limits: TopicLimits) -> StagedPayload:
    """The pieces of a stage's ``staged`` value; a value over ``max_event_bytes`` raises ``EventTooLargeError``."""
    _, value = encode_event_value(event)
    check_event_size(event, len(value), limits.max_event_bytes)
    digest = sha256_hex(value)
    count = max(1, -(-len(value) // chunk_bytes))
    key = event.rollout_id.encode()
    return StagedPayload(
        len(value),
        digest,
        [
            OutgoingMessage(
                key,
                value[index * chunk_bytes : (index + 1) * chunk_bytes],
                [
                    (HEADER_TYPE, PAYLOAD_TYPE.encode()),
                    (HEADER_SCHEMA, str(PAYLOAD_SCHEMA).encode()),
                    (HEADER_WRITER, event.writer.encode()),
                    (HEADER_PAYLOAD_DIGEST, digest.encode()),
                    (HEADER_PAYLOAD_INDEX, str(index).encode()),
                    (HEADER_PAYLOAD_COUNT, str(count).encode()),
                ],
            )
            for index in range(count)
        ],
    )


def encode_staged_reference(
    event: StageEvent, payload: StagedPayload, topic: str, partition: int, offsets: list[int]
) -> OutgoingMessage:
    """The run topic's ``stage`` message for a payload the broker stored at these offsets of ``topic``."""
    if len(offsets) != len(payload.pieces):
        raise ValueError(f"{len(payload.pieces)} pieces were sent but {len(offsets)} offsets given")
    value = orjson.dumps(
        {
            "model_call_id": event.model_call_id,
            "offsets": offsets,
            "partition": partition,
            "rollout_id": event.rollout_id,
            "schema": PAYLOAD_SCHEMA,
            "sha256": payload.sha256,
            "size": payload.value_size,
            "staging_key": event.staging_key,
            "topic": topic,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return OutgoingMessage(
        event.rollout_id.encode(),
        value,
        [
            (HEADER_TYPE, event.type.value.encode()),
            (HEADER_SCHEMA, str(event.schema_version).encode()),
            (HEADER_WRITER, event.writer.encode()),
            (HEADER_ENCODING, ENCODING_STAGED_REFERENCE.encode()),
        ],
    )


def _whole_number(raw: dict[str, Any], name: str) -> int:
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EventDecodeError(f"staged reference field {name!r} must be a whole number, got {value!r:.80}")
    return value


def _text(raw: dict[str, Any], name: str) -> str:
    value = raw[name]
    if not isinstance(value, str) or not value:
        raise EventDecodeError(f"staged reference field {name!r} must be non-empty text, got {value!r:.80}")
    return value


def decode_reference(value: bytes | None) -> StagedReference:
    """The reference a ``staged-ref`` value holds; anything but exactly its fields raises ``EventDecodeError``."""
    try:
        raw: Any = orjson.loads(value or b"")
    except orjson.JSONDecodeError as exc:
        raise EventDecodeError(f"staged reference is not JSON: {exc}") from exc
    if not isinstance(raw, dict) or set(raw) != _REFERENCE_FIELDS:
        raise EventDecodeError(
            f"staged reference must hold exactly {sorted(_REFERENCE_FIELDS)}, got {raw!r:.200}"
        )
    if raw["schema"] != PAYLOAD_SCHEMA:
        raise EventDecodeError(
            f"staged reference has schema {raw['schema']!r}; this tokcap reads {PAYLOAD_SCHEMA}. Upgrade tokcap"
        )
    offsets = raw["offsets"]
    if (
        not isinstance(offsets, list)
        or not offsets
        or any(isinstance(o, bool) or not isinstance(o, int) or o < 0 for o in offsets)
    ):
        raise EventDecodeError(f"staged reference offsets must be whole numbers, got {offsets!r:.200}")
    sha = _text(raw, "sha256")
    if _SHA256.fullmatch(sha) is None:
        raise EventDecodeError(f"staged reference sha256 must be 64 lowercase hex digits, got {sha!r:.80}")
    return StagedReference(
        rollout_id=_text(raw, "rollout_id"),
        staging_key=_text(raw, "staging_key"),
        model_call_id=_text(raw, "model_call_id"),
        topic=_text(raw, "topic"),
        partition=_whole_number(raw, "partition"),
        offsets=tuple(offsets),
        size=_whole_number(raw, "size"),
        sha256=sha,
    )


class PositionReader(Protocol):
    """Reads the message at a position of one topic (``client.offset_reader.OffsetReader`` is one)."""

    def read(self, partition: int, offset: int) -> LogMessage | None:
        """The message there; ``None`` when the log no longer (or never) holds it; raises when it cannot tell."""
        ...

    def close(self) -> None:
        """Release the reader's client."""
        ...


@dataclass
class StagedPayloadRestorer:
    """Restores the stage a reference names from the staged-payload topic; the inbound router holds one.

    ``open_reader`` opens a reader of the payload topic, on first use; without it a reference raises
    ``TransportError`` (the reader was built without a way to the payload topic), never a dead letter.
    """

    open_reader: Callable[[str], PositionReader] | None = None
    pieces_read: int = 0
    """Pieces read from the payload topic (a counter for benchmarks and tests)."""
    _readers: dict[str, PositionReader] = field(default_factory=dict)

    def restore(
        self, key: bytes | None, value: bytes | None, headers: Mapping[str, str], limits: TopicLimits
    ) -> tuple[StageEvent, int]:
        """The stage a reference message names, and the size of its payload (what holding it costs a reader);
        ``EventDecodeError`` when it cannot be the stage it claims."""
        reference = decode_reference(value)
        if limits.staged_payload_topic is None:
            raise EventDecodeError(
                f"staged reference of {reference.staging_key!r} names topic {reference.topic!r}, but the run "
                "topic's limits record names no staged-payload topic"
            )
        if reference.topic != limits.staged_payload_topic:
            raise EventDecodeError(
                f"staged reference of {reference.staging_key!r} names topic {reference.topic!r}; the run topic's "
                f"staged payloads are on {limits.staged_payload_topic!r}"
            )
        if reference.size > limits.max_event_bytes:
            raise EventDecodeError(
                f"staged payload of {reference.staging_key!r} is {reference.size:,} bytes, over the topic's "
                f"max_event_bytes of {limits.max_event_bytes:,}"
            )
        if key != reference.rollout_id.encode():
            raise EventDecodeError(
                f"key {key!r} does not match the staged reference's rollout {reference.rollout_id!r}"
            )
        joined = self._joined(reference, key)
        event = decode_message(key, joined, {**headers, HEADER_ENCODING: ENCODING_STAGED})
        if (
            not isinstance(event, StageEvent)
            or event.staging_key != reference.staging_key
            or event.model_call_id != reference.model_call_id
        ):
            raise EventDecodeError(
                f"the staged payload at {reference.topic!r} partition {reference.partition} is not the stage of "
                f"{reference.staging_key!r} its reference names"
            )
        return event, reference.size

    def _joined(self, reference: StagedReference, key: bytes) -> bytes:
        """The pieces' bytes joined, each checked to be the piece the reference names, then the whole checked."""
        reader = self._reader(reference.topic)
        count = len(reference.offsets)
        parts: list[bytes] = []
        for index, offset in enumerate(reference.offsets):
            where = f"offset {offset} of partition {reference.partition} of {reference.topic!r}"
            piece = reader.read(reference.partition, offset)
            self.pieces_read += 1
            if piece is None:
                raise EventDecodeError(
                    f"piece {index} of the staged payload of {reference.staging_key!r} ({where}) is no longer "
                    "in the log"
                )
            piece_headers = headers_to_dict(piece.headers)
            expected = {
                HEADER_TYPE: PAYLOAD_TYPE,
                HEADER_PAYLOAD_DIGEST: reference.sha256,
                HEADER_PAYLOAD_INDEX: str(index),
                HEADER_PAYLOAD_COUNT: str(count),
            }
            wrong = [name for name, wanted in expected.items() if piece_headers.get(name) != wanted]
            if wrong or piece.key != key:
                raise EventDecodeError(
                    f"the message at {where} is not piece {index} of {count} of the staged payload of "
                    f"{reference.staging_key!r} (mismatched: {', '.join(wrong) or 'key'})"
                )
            parts.append(piece.value or b"")
        joined = b"".join(parts)
        if len(joined) != reference.size or sha256_hex(joined) != reference.sha256:
            raise EventDecodeError(
                f"the staged payload of {reference.staging_key!r} does not match the size and SHA-256 its "
                "reference names"
            )
        return joined

    def _reader(self, topic: str) -> PositionReader:
        reader = self._readers.get(topic)
        if reader is None:
            if self.open_reader is None:
                raise TransportError(
                    f"a staged reference names payload topic {topic!r}, but this reader was built without a way "
                    "to read it; build its inbound router with a StagedPayloadRestorer"
                )
            reader = self._readers[topic] = self.open_reader(topic)
        return reader

    def close(self) -> None:
        """Close every payload-topic reader opened."""
        readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            reader.close()

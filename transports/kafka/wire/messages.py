"""A run topic's message as tokcap reads and writes it: its key, its headers, and a message read from the log.

A message is keyed by the rollout id, so a rollout's events stay in order in one partition. Headers carry
the event type, the event schema version, the writer id and the value encoding; a chunk of a value too large
for one message carries ``(group id, index, count, sha256 of the whole value)`` headers as well. Every reader
and writer names headers through the constants here, so no two modules spell one differently.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from tokcap.errors import EventDecodeError, InvalidRolloutIdError
from tokcap.log.rollout_ids import validate_rollout_id

__all__ = [
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
    "ChunkHeader",
    "ConsumedMessage",
    "LogMessage",
    "OutgoingMessage",
    "header_pairs",
    "headers_to_dict",
    "read_chunk_header",
    "rollout_of_key",
    "type_header",
]

HEADER_TYPE = "tokcap.type"
HEADER_SCHEMA = "tokcap.schema_version"
HEADER_WRITER = "tokcap.writer"
HEADER_ENCODING = "tokcap.encoding"
HEADER_CHUNK_GROUP = "tokcap.chunk.group"
HEADER_CHUNK_INDEX = "tokcap.chunk.index"
HEADER_CHUNK_COUNT = "tokcap.chunk.count"
HEADER_CHUNK_DIGEST = "tokcap.chunk.sha256"

ENCODING_JSON = "json"
ENCODING_PACKED = "packed"
ENCODING_DELTA = "delta"
ENCODING_STAGED = "staged"
ENCODING_STAGED_REFERENCE = "staged-ref"
"""A ``stage`` message whose value names where its ``staged`` value lies on the staged-payload topic."""


@dataclass(frozen=True)
class OutgoingMessage:
    """One message ready for ``Producer.produce``."""

    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    partition: int | None = None
    """The partition to send to; ``None`` lets the key's partitioner choose."""


class ConsumedMessage(Protocol):
    """What ``LogMessage.of`` reads of a message a consumer returned (confluent-kafka's ``Message`` is one).

    Named here so the wire floor needs no Kafka client to describe it.
    """

    def partition(self) -> int | None: ...
    def offset(self) -> int | None: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def timestamp(self) -> tuple[int, int]: ...
    def headers(
        self,
    ) -> dict[str, str | bytes | None] | list[tuple[str, str | bytes | None]] | None: ...


@dataclass(frozen=True)
class LogMessage:
    """One message as read from the log."""

    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    value: bytes | None

    @property
    def size(self) -> int:
        """Bytes of key and value, what the message costs on the broker before compression."""
        return len(self.key or b"") + len(self.value or b"")

    @classmethod
    def of(cls, message: ConsumedMessage) -> LogMessage:
        """The message a consumer returned, without its error (the caller handled that)."""
        kind, stamp = message.timestamp()
        return cls(
            partition=int(message.partition() or 0),
            offset=int(message.offset() or 0),
            timestamp_ms=int(stamp) if kind != 0 else None,
            key=message.key(),
            headers=header_pairs(message.headers()),
            value=message.value(),
        )


def header_pairs(
    headers: Mapping[str, str | bytes | None] | Iterable[tuple[str, str | bytes | None]] | None,
) -> tuple[tuple[str, bytes | None], ...]:
    """Headers as ``(name, bytes)`` pairs in their order on the message: ``headers_to_dict`` the other way."""
    pairs = headers.items() if isinstance(headers, Mapping) else (headers or [])
    return tuple((name, value.encode() if isinstance(value, str) else value) for name, value in pairs)


@dataclass(frozen=True)
class ChunkHeader:
    """Where a chunk belongs: its group, its place in it, and the digest of the reassembled value."""

    group: str
    index: int
    count: int
    digest: str

    @property
    def session(self) -> str:
        """The producing sink instance; its chunks of one group are contiguous in its own output."""
        return self.group.rsplit(":", 1)[0]


def headers_to_dict(
    headers: Iterable[tuple[str, str | bytes | None]] | Mapping[str, str | bytes | None] | None,
) -> dict[str, str]:
    """Message headers as text; undecodable header bytes make the event undecodable."""
    result: dict[str, str] = {}
    pairs = headers.items() if isinstance(headers, Mapping) else (headers or ())
    for name, raw in pairs:
        if isinstance(raw, str):
            result[name] = raw
            continue
        try:
            result[name] = (raw or b"").decode()
        except UnicodeDecodeError as exc:
            raise EventDecodeError(f"header {name!r} is not UTF-8") from exc
    return result


def type_header(headers: Iterable[tuple[str, str | bytes | None]]) -> str | None:
    """The message's ``type`` header as text, read alone; ``None`` when it is missing or not UTF-8.

    A reader that passes over some event types tells them by this header without decoding anything else.
    """
    for name, raw in headers:
        if name == HEADER_TYPE:
            if isinstance(raw, str):
                return raw
            try:
                return (raw or b"").decode()
            except UnicodeDecodeError:
                return None
    return None


def _header_int(headers: Mapping[str, str], name: str) -> int:
    try:
        return int(headers[name])
    except (KeyError, ValueError) as exc:
        raise EventDecodeError(f"header {name!r} is missing or not an integer") from exc


def read_chunk_header(headers: Mapping[str, str]) -> ChunkHeader | None:
    """The chunk header of a message, ``None`` for a whole event; a partial chunk header is an error."""
    names = (HEADER_CHUNK_GROUP, HEADER_CHUNK_INDEX, HEADER_CHUNK_COUNT, HEADER_CHUNK_DIGEST)
    present = [name for name in names if name in headers]
    if not present:
        return None
    if len(present) != len(names):
        raise EventDecodeError(f"chunk headers are incomplete: only {present}")
    header = ChunkHeader(
        group=headers[HEADER_CHUNK_GROUP],
        index=_header_int(headers, HEADER_CHUNK_INDEX),
        count=_header_int(headers, HEADER_CHUNK_COUNT),
        digest=headers[HEADER_CHUNK_DIGEST],
    )
    if header.count < 2 or not 0 <= header.index < header.count or not header.group:
        raise EventDecodeError(f"chunk header {header} is inconsistent")
    return header


def rollout_of_key(key: bytes | None) -> str | None:
    """The rollout id a message key names, or ``None`` when the key is not a valid id."""
    if key is None:
        return None
    try:
        return validate_rollout_id(key.decode())
    except (UnicodeDecodeError, InvalidRolloutIdError):
        return None

"""The size limits of one run topic, and where its staged payloads go, decided once when the topic is made and
read by every writer and reader.

A sink refuses an event larger than ``max_event_bytes`` before sending any of it; a reader reassembling chunk
groups dead-letters a larger one and masks its rollout, and holds at most ``max_open_chunk_bytes`` of open
groups per partition. Both sides must use the same numbers, or a writer answers ok for an event every reader
drops. So the numbers belong to the topic, not to each process: ``ensure_topic`` (``tokcap topic create``)
writes them as the topic's first message, a limits record at offset 0 of partition 0, before anything else.

The broker takes no custom topic settings, so the record lives in the log itself, read the way the topic's
incarnation is: a callable reads it (``limits_record``), a reader when it starts and a writer for its first
event that needs chunks, and this module only decides what it means. Offset 0 of partition 0 is the only
place a limits record counts:

- a limits record there gives the topic's limits;
- any other message there means the topic was made before limits were recorded: it has the defaults;
- an empty partition 0 has no limits yet: a component starting on it uses the defaults, and a reader that
  later meets a record saying otherwise stops (``check_recorded``) instead of deciding with other numbers.

A limits record anywhere else is a claim that lost (another process made the topic first) or a crafted
message; readers pass over it. This module imports no Kafka client.

A topic made with a staged-payload topic (``staged_payload_topic``, schema 2 of the record) keeps each staged
call's bytes there and only a small reference on the run topic (``staged_payloads``), so a reader that needs
ledger rows and commands alone never fetches staged tokens and attachments. A topic whose record names none
(schema 1, or no record) carries staged calls inline. A reader that only knows schema 1 refuses a schema 2
record and asks for an upgrade: it could not read the references.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from tokcap.errors import ConfigError, EventDecodeError, NewerSchemaError
from transports.kafka.errors import TopicLimitsMismatchError

__all__ = [
    "LIMITS_PARTITION",
    "LIMITS_RECORD_SCHEMA",
    "LIMITS_RECORD_TYPE",
    "LIMITS_WRITER",
    "TOPIC_DEFAULTS",
    "TopicLimits",
    "check_given",
    "check_recorded",
    "decode_limits_record",
    "encode_limits_record",
    "is_limits_record",
    "limits_at_start",
    "warn_given",
]

LIMITS_RECORD_TYPE = "topic-limits"
"""The ``tokcap.type`` header of a limits record."""

LIMITS_RECORD_SCHEMA = 2
"""The newest ``tokcap.schema_version`` of a limits record this version reads; it writes 2 only for a topic with a
staged-payload topic, so a record without one is byte for byte what schema 1 wrote."""

_SCHEMA_FIELDS = {
    1: frozenset({"max_event_bytes", "max_open_chunk_bytes"}),
    2: frozenset({"max_event_bytes", "max_open_chunk_bytes", "staged_payload_topic"}),
}

LIMITS_WRITER = "tokcap-topic-create"
"""The ``tokcap.writer`` header of a limits record."""

LIMITS_PARTITION = 0
"""The partition whose offset 0 holds the topic's limits record."""

_TYPE_HEADER = "tokcap.type"
_SCHEMA_HEADER = "tokcap.schema_version"
_WRITER_HEADER = "tokcap.writer"
_ENCODING_HEADER = "tokcap.encoding"


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive whole number of bytes, got {value!r}")
    return value


@dataclass(frozen=True)
class TopicLimits:
    """How large one event may be, and how many bytes of open chunk groups a reader holds per partition.

    ``max_open_chunk_bytes`` defaults to twice ``max_event_bytes``: one event of the largest size can be
    reassembled while other writers' groups are open beside it.
    """

    max_event_bytes: int = 256 * 1024 * 1024
    """Largest event value, whole or reassembled from chunks. Routed experts of a large MoE at long context and
    media attachments are a few to tens of MiB; 256 MiB leaves room for both while bounding what one event can
    cost a reader."""
    max_open_chunk_bytes: int = 0
    """Value bytes the open chunk groups of one partition may hold together; ``0`` asks for the default."""
    staged_payload_topic: str | None = None
    """The topic that holds the bytes of every staged call, the run topic only a reference to them; ``None``:
    staged calls travel inline on the run topic."""

    def __post_init__(self) -> None:
        """Refuse limits no reader could live by; fill in the open-chunk budget left to its default."""
        _positive(self.max_event_bytes, "max_event_bytes")
        if self.max_open_chunk_bytes == 0 and not isinstance(self.max_open_chunk_bytes, bool):
            object.__setattr__(self, "max_open_chunk_bytes", 2 * self.max_event_bytes)
        _positive(self.max_open_chunk_bytes, "max_open_chunk_bytes")
        if self.staged_payload_topic is not None and (
            not isinstance(self.staged_payload_topic, str) or not self.staged_payload_topic
        ):
            raise ConfigError(f"staged_payload_topic must name a topic, got {self.staged_payload_topic!r}")
        if self.max_open_chunk_bytes < self.max_event_bytes:
            raise ConfigError(
                f"max_open_chunk_bytes ({self.max_open_chunk_bytes}) must be at least max_event_bytes "
                f"({self.max_event_bytes}), or an event of the largest size could never be reassembled"
            )

    def describe(self) -> str:
        """The limits in a line, for messages."""
        sizes = (
            f"max_event_bytes={self.max_event_bytes:,}, max_open_chunk_bytes={self.max_open_chunk_bytes:,}"
        )
        if self.staged_payload_topic is None:
            return sizes
        return f"{sizes}, staged_payload_topic={self.staged_payload_topic}"

    def to_dict(self) -> dict[str, int | str]:
        """The limits as the record's value holds them (the payload topic only when there is one)."""
        held: dict[str, int | str] = {
            "max_event_bytes": self.max_event_bytes,
            "max_open_chunk_bytes": self.max_open_chunk_bytes,
        }
        if self.staged_payload_topic is not None:
            held["staged_payload_topic"] = self.staged_payload_topic
        return held

    @property
    def schema_version(self) -> int:
        """The record schema these limits need: 2 names a staged-payload topic, 1 does not."""
        return 1 if self.staged_payload_topic is None else 2

    def sizes_equal(self, other: TopicLimits) -> bool:
        """Whether both size limits agree, whatever each says of staged payloads."""
        return (self.max_event_bytes, self.max_open_chunk_bytes) == (
            other.max_event_bytes,
            other.max_open_chunk_bytes,
        )


TOPIC_DEFAULTS = TopicLimits()
"""The limits of a topic made before limits were recorded, and of one made without asking for others."""


def encode_limits_record(limits: TopicLimits) -> tuple[bytes, list[tuple[str, str | bytes | None]]]:
    """The value and headers of the limits record; the value is canonical JSON (sorted keys, ASCII)."""
    value = orjson.dumps(limits.to_dict(), option=orjson.OPT_SORT_KEYS)
    headers: list[tuple[str, str | bytes | None]] = [
        (_TYPE_HEADER, LIMITS_RECORD_TYPE.encode()),
        (_SCHEMA_HEADER, str(limits.schema_version).encode()),
        (_WRITER_HEADER, LIMITS_WRITER.encode()),
        (_ENCODING_HEADER, b"json"),
    ]
    return value, headers


def is_limits_record(headers: Mapping[str, str]) -> bool:
    """Whether a message's (decoded) headers name it a limits record."""
    return headers.get(_TYPE_HEADER) == LIMITS_RECORD_TYPE


def decode_limits_record(value: bytes | None, headers: Mapping[str, str]) -> TopicLimits:
    """The limits a record holds; a record of a newer schema or with other fields is refused."""
    schema = headers.get(_SCHEMA_HEADER, "")
    if not schema.isdigit():
        raise EventDecodeError(f"the topic's limits record has schema version {schema!r}, not a number")
    if int(schema) > LIMITS_RECORD_SCHEMA:
        raise NewerSchemaError(
            f"the topic's limits record has schema version {schema}; this tokcap reads up to "
            f"{LIMITS_RECORD_SCHEMA}. Upgrade tokcap on this node"
        )
    try:
        raw: Any = orjson.loads(value or b"")
    except orjson.JSONDecodeError as exc:
        raise EventDecodeError(f"the topic's limits record is not JSON: {exc}") from exc
    fields = _SCHEMA_FIELDS.get(int(schema))
    if fields is None or not isinstance(raw, dict) or set(raw) != fields:
        wanted = sorted(fields or ())
        raise EventDecodeError(
            f"the topic's limits record of schema {schema} must hold exactly {wanted}, got {raw!r:.200}"
        )
    try:
        return TopicLimits(
            raw["max_event_bytes"], raw["max_open_chunk_bytes"], raw.get("staged_payload_topic")
        )
    except ConfigError as exc:
        raise EventDecodeError(f"the topic's limits record holds limits no reader can use: {exc}") from exc


def limits_at_start(first: tuple[bytes | None, Mapping[str, str]] | None) -> TopicLimits:
    """The topic's limits from the value and headers at offset 0 of partition 0 (``None``: nothing there yet)."""
    if first is None:
        return TOPIC_DEFAULTS
    value, headers = first
    if is_limits_record(headers):
        return decode_limits_record(value, headers)
    return TOPIC_DEFAULTS


def check_recorded(topic: str, recorded: TopicLimits, used: TopicLimits) -> None:
    """Refuse to read on with ``used`` once the topic's record at offset 0 says ``recorded``.

    Only a component that started while partition 0 was still empty can meet this: it took the defaults, and
    the record was written after it started.
    """
    if recorded != used:
        raise TopicLimitsMismatchError(
            f"topic {topic!r} records its limits as {recorded.describe()}, but this reader started before the "
            f"record was written and used {used.describe()}; start it again. Make a topic with `tokcap topic "
            "create` (or ensure_topic) before starting any sink or reader on it"
        )


def warn_given(who: str, given: Mapping[str, int | None]) -> None:
    """Warn that limits given to a constructor or config block are deprecated: the topic's decide.

    Giving them is kept for one release, as a check against the topic's (``check_given``), so a config that
    names them still works where it agrees with the topic.
    """
    named = [name for name, value in given.items() if value is not None]
    if named:
        warnings.warn(
            f"{who}: {' and '.join(named)} is deprecated and sets nothing; the topic's limits decide (set them "
            "when the topic is made: `tokcap topic create --max-event-bytes N`, or "
            "ensure_topic(limits=TopicLimits(...))). Given, it is only checked against the topic's, and the "
            "next release refuses it",
            DeprecationWarning,
            stacklevel=3,
        )


def check_given(
    who: str,
    topic: str,
    topic_limits: TopicLimits,
    *,
    max_event_bytes: int | None = None,
    max_open_chunk_bytes: int | None = None,
) -> None:
    """Refuse limits given to a constructor or config block that differ from the topic's (``None``: not given)."""
    given = {"max_event_bytes": max_event_bytes, "max_open_chunk_bytes": max_open_chunk_bytes}
    actual = topic_limits.to_dict()
    wrong = [
        f"{name}={value:,} (the topic has {actual[name]:,})"
        for name, value in given.items()
        if value is not None and value != actual[name]
    ]
    if wrong:
        raise TopicLimitsMismatchError(
            f"{who} was given {', '.join(wrong)}, but topic {topic!r} has {topic_limits.describe()}: every sink "
            "and reader uses the topic's limits. Remove the setting from the constructor or config block; to "
            "run with other limits, make a new topic with them (`tokcap topic create --max-event-bytes N`)"
        )

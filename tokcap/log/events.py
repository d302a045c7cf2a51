"""The events that change a rollout, and their one canonical byte encoding.

Every change to a rollout is one of these events.
The file store builds an event and applies it at once.
The Kafka transport publishes the same events and a materializer applies them.
This module is pure: no clock, no random numbers, no I/O.

Encoding: JSON with sorted keys (orjson), one object per event, carrying
``schema_version`` and ``type``. A reader refuses a newer ``schema_version``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    StrictInt,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)

from tokcap.errors import EventDecodeError, NewerSchemaError
from tokcap.log.records import TOKEN_ENTRY_RECORD_SCHEMA_VERSION, TokenEntry, entry_digest

__all__ = [
    "EVENT_SCHEMA_VERSION",
    "LOG_READER_WRITER",
    "MARKER_ID_PATTERN",
    "CancelEvent",
    "DeleteEvent",
    "DropEvent",
    "Event",
    "EventType",
    "FreezeEvent",
    "IncompleteEvent",
    "IntentEvent",
    "LedgerEvent",
    "LedgerFailureEvent",
    "LogPosition",
    "PutEvent",
    "RetireEvent",
    "StageEvent",
    "StagedBlob",
    "decode_event",
    "encode_event",
    "event_from_mapping",
]

EVENT_SCHEMA_VERSION = 1
"""The newest event schema this reader understands."""


class EventType(enum.StrEnum):
    """The kinds of change a rollout can undergo."""

    INTENT = "intent"
    CANCEL = "cancel"
    PUT = "put"
    INCOMPLETE = "incomplete"
    FREEZE = "freeze"
    DROP = "drop"
    RETIRE = "retire"
    DELETE = "delete"
    STAGE = "stage"
    LEDGER = "ledger"
    LEDGER_FAILURE = "ledger-failure"


class _EventBase(BaseModel):
    """Fields every event carries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: StrictInt = EVENT_SCHEMA_VERSION
    rollout_id: str
    writer: str = ""


class IntentEvent(_EventBase):
    """A call is about to be dispatched; if its entry never arrives the rollout is masked."""

    type: Literal[EventType.INTENT] = EventType.INTENT
    model_call_id: str


class CancelEvent(_EventBase):
    """A call ended without generation; its intent is closed and masks nothing."""

    type: Literal[EventType.CANCEL] = EventType.CANCEL
    model_call_id: str


class PutEvent(_EventBase):
    """The record of one call."""

    type: Literal[EventType.PUT] = EventType.PUT
    entry: TokenEntry

    @functools.cached_property
    def entry_line(self) -> bytes:
        """The entry's canonical JSON, encoded once per event.

        A put read from Kafka is encoded to prove its wire delta, decided when its freeze is answered ahead
        and decided again when it is applied; each encode of a long entry costs tens of microseconds. The
        value is kept on the event, so an event's entry must not be changed once this is read (nothing in
        tokcap does; the event itself is frozen). Like any cached property it is not a field: dumps and
        comparisons ignore it.
        """
        return self.entry.canonical_json()

    @functools.cached_property
    def payload_digest(self) -> str:
        """The entry's payload digest (``TokenEntry.payload_digest``), computed once per event."""
        return entry_digest(self.entry_line)

    @model_validator(mode="after")
    def _same_rollout(self) -> PutEvent:
        """An event keyed by one rollout must not smuggle another rollout's record."""
        if self.entry.rollout_id != self.rollout_id:
            raise ValueError(
                f"put event for rollout {self.rollout_id!r} carries an entry of rollout {self.entry.rollout_id!r}"
            )
        return self


MARKER_ID_PATTERN = r"^[A-Za-z0-9._:-]{0,128}$"
"""A marker id: short, printable and safe in a file name."""


LOG_READER_WRITER = "tokcap-materializer"
"""Writer id of the masks a log reader decides itself: a dead-lettered message's, an abandoned chunk group's."""


class IncompleteEvent(_EventBase):
    """A call failed to capture; the rollout must be masked.

    ``marker_id``, when set, names this marker uniquely: a sink that may send it twice (it spilled the
    marker while the broker was down and forwards it later) sets it, and the apply step applies a marker
    id once. It is encoded only when set, so markers without one keep their canonical bytes.
    """

    type: Literal[EventType.INCOMPLETE] = EventType.INCOMPLETE
    model_call_id: str = ""
    reason: str = ""
    marker_id: str = Field(default="", pattern=MARKER_ID_PATTERN)

    @model_serializer(mode="wrap")
    def _omit_empty_marker_id(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and not self.marker_id:
            data.pop("marker_id", None)
        return data


class FreezeEvent(_EventBase):
    """The cut: nothing after this is part of the rollout."""

    type: Literal[EventType.FREEZE] = EventType.FREEZE


class DropEvent(_EventBase):
    """Retire exactly this snapshot if the rollout is still in that frozen state."""

    type: Literal[EventType.DROP] = EventType.DROP
    snapshot_id: str
    version: StrictInt


class RetireEvent(_EventBase):
    """Remove the records and keep the fence, whatever the state."""

    type: Literal[EventType.RETIRE] = EventType.RETIRE


class DeleteEvent(_EventBase):
    """Remove the records and the fence so the rollout id can be reused."""

    type: Literal[EventType.DELETE] = EventType.DELETE


class StagedBlob(BaseModel):
    """Bytes stored beside a staged row (its extras, or one attachment), named by their SHA-256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: StrictInt = Field(ge=0)


def _line(value: dict[str, Any]) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS) + b"\n"


class StageEvent(_EventBase):
    """An inference worker staged one call's token delta (Gym's ``StagedCallRecord``) under its key.

    ``row`` is the staged record without its extras, as JSON; the extras and every attachment are blobs
    named by their SHA-256, so a reader of the token columns never parses them.
    """

    type: Literal[EventType.STAGE] = EventType.STAGE
    staging_key: str
    model_call_id: str
    row: dict[str, Any]
    extras: StagedBlob | None = None
    attachments: dict[str, StagedBlob] = Field(default_factory=dict)
    _blob_bytes: dict[str, bytes] = PrivateAttr(default_factory=dict)

    def blob_refs(self) -> list[StagedBlob]:
        """The blobs the row names, extras first, then the attachments by name: the order they travel in."""
        refs = [] if self.extras is None else [self.extras]
        return refs + [self.attachments[name] for name in sorted(self.attachments)]

    def with_blob_bytes(self, blobs: dict[str, bytes]) -> StageEvent:
        """Carry the bytes of the named blobs (by SHA-256) with the event, for a store that has not got them.

        A stage read from a run topic brings its blobs; the store writes them, durably, before the row that
        names them. The bytes are no field: dumps and the stored line ignore them.
        """
        self._blob_bytes = blobs
        return self

    @property
    def blob_bytes(self) -> dict[str, bytes]:
        """The bytes carried with the event, by SHA-256 (empty when the store already holds the blobs)."""
        return self._blob_bytes

    @functools.cached_property
    def stored_line(self) -> bytes:
        """The line the store keeps for this staged call; equal lines mean an identical repeat."""
        return _line(
            {
                "attachments": {name: blob.model_dump() for name, blob in self.attachments.items()},
                "extras": None if self.extras is None else self.extras.model_dump(),
                "row": self.row,
                "staging_key": self.staging_key,
            }
        )


class LedgerEvent(_EventBase):
    """Gym's model server committed a staged call: its token-free ledger row.

    ``row`` holds the custody columns and lookup fingerprints (Gym's ledger row); ``commit_digest`` is the
    SHA-256 of the whole commit, request items included, so any difference in a repeat is seen.
    """

    type: Literal[EventType.LEDGER] = EventType.LEDGER
    model_call_id: str
    commit_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    row: dict[str, Any]

    @functools.cached_property
    def stored_line(self) -> bytes:
        """The ledger line of this row."""
        return _line({**self.row, "commit_digest": self.commit_digest, "model_call_id": self.model_call_id})


class LedgerFailureEvent(_EventBase):
    """A call whose capture did not commit; it poisons the rollout and never resolves a parent."""

    type: Literal[EventType.LEDGER_FAILURE] = EventType.LEDGER_FAILURE
    model_call_id: str
    reason: str

    @functools.cached_property
    def stored_line(self) -> bytes:
        """The ledger line of this failure, in Gym's shape."""
        return _line({"failure_reason": self.reason, "model_call_id": self.model_call_id})


Event = Annotated[
    IntentEvent
    | CancelEvent
    | PutEvent
    | IncompleteEvent
    | FreezeEvent
    | DropEvent
    | RetireEvent
    | DeleteEvent
    | StageEvent
    | LedgerEvent
    | LedgerFailureEvent,
    Field(discriminator="type"),
]

_EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
_EVENT_TYPE_NAMES = frozenset(member.value for member in EventType)


@dataclass(frozen=True, order=True)
class LogPosition:
    """Where a decision sits in the log: the arbiter of order in the Kafka path.

    ``index`` orders the decisions routing one message takes about one rollout: a chunk group that the
    message abandons masks its rollout at index 0, before the message's own event at index 1. Most messages
    decide once per rollout, at index 0.
    """

    topic: str
    partition: int
    offset: int
    index: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON form stored beside what the event changed; ``index`` only when it is not 0, as older files hold."""
        out: dict[str, Any] = {"topic": self.topic, "partition": self.partition, "offset": self.offset}
        if self.index:
            out["index"] = self.index
        return out

    @classmethod
    def from_mapping(cls, raw: Any) -> LogPosition:
        """Read the JSON form back; a position written before ``index`` existed sits at index 0."""
        if isinstance(raw, LogPosition):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(f"a log position must be a JSON object, got {type(raw).__name__}")
        topic, partition, offset = raw.get("topic"), raw.get("partition"), raw.get("offset")
        index = raw.get("index", 0)
        if (
            isinstance(topic, str)
            and isinstance(partition, int)
            and isinstance(offset, int)
            and isinstance(index, int)
            and not any(isinstance(number, bool) for number in (partition, offset, index))
        ):
            return cls(topic, partition, offset, index)
        raise ValueError(f"a log position needs a topic and integer partition, offset and index, got {raw!r}")

    def same_message(self, other: LogPosition) -> bool:
        """Whether both decisions were taken routing one message (one event: one freeze or command)."""
        return (self.topic, self.partition, self.offset) == (other.topic, other.partition, other.offset)


def encode_event(event: Event) -> bytes:
    """The canonical bytes of an event: sorted-key JSON."""
    return orjson.dumps(event.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


def decode_event(data: bytes) -> Event:
    """Parse canonical bytes; refuse newer schemas and anything that is not an event."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise EventDecodeError(f"event is not valid JSON: {exc}") from exc
    return event_from_mapping(raw)


def event_from_mapping(raw: Any) -> Event:
    """Validate decoded JSON into an event with tokcap's error classes."""
    if not isinstance(raw, dict):
        raise EventDecodeError(f"event must be a JSON object, got {type(raw).__name__}")
    version = raw.get("schema_version")
    if isinstance(version, int) and version > EVENT_SCHEMA_VERSION:
        raise NewerSchemaError(
            f"event schema_version {version} is newer than {EVENT_SCHEMA_VERSION}; upgrade tokcap on the reader"
        )
    entry = raw.get("entry")
    if isinstance(entry, dict):
        entry_version = entry.get("schema_version")
        if isinstance(entry_version, int) and entry_version > TOKEN_ENTRY_RECORD_SCHEMA_VERSION:
            raise NewerSchemaError(
                f"record schema_version {entry_version} is newer than this reader; upgrade tokcap on the reader"
            )
    if raw.get("type") not in _EVENT_TYPE_NAMES:
        raise EventDecodeError(f"unknown event type {raw.get('type')!r}")
    try:
        return _EVENT_ADAPTER.validate_python(raw)
    except ValidationError as exc:
        raise EventDecodeError(f"invalid {raw.get('type')} event: {exc}") from exc

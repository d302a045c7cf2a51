"""Events as Kafka messages, and back.

A message is keyed by the rollout id, so a rollout's events stay in order in one partition.
Headers carry the event type, the event schema version, the writer id and the value encoding.

Values:

- ``json``: the canonical ``tokcap.log.events`` encoding (every event but ``put``).
- ``staged``: a ``stage`` event and the bytes of the blobs it names (its extras, its attachments).
  Layout: magic ``TKS1``, a little-endian u32 length, the event's canonical JSON, then each blob's bytes in
  the order ``StageEvent.blob_refs`` gives. A reader checks every blob's size and SHA-256 against the row.
- ``staged-ref``: a ``stage`` event whose ``staged`` value lies on the topic's staged-payload topic; the value
  says where (``staged_payloads``), and only the inbound router, which can read that topic, decodes it.
- ``packed``: a ``put`` event with its token arrays packed as binary, so a long prompt stays small.
  Layout: magic ``TKP1``, a little-endian u32 length, the event's JSON without the three arrays
  (which instead lists each array's dtype and count), then the arrays' bytes in that order.
  Ids are ``<i4`` when they fit, else ``<i8``; log probs are ``<f8``, so every value round-trips exactly.
  Ids beyond 64 bits are refused (the canonical JSON encoder cannot write them either).

Every event decoded here passes the sinks' input rules (``tokcap.log.input_rules.accept_event``) before anyone
gets it: what a sink would have refused to send is refused the same way when it is read, as an
``EventDecodeError`` whose text names the field, which the router dead-letters. A packed id array must use
an integer dtype and hold no negative value; that is checked on its bytes, before it is decoded.

A value larger than the chunk size is split into chunk messages that carry
``(group id, index, count, sha256 of the whole value)`` headers; the inbound router reassembles them.
No value larger than the topic's ``max_event_bytes`` (``topic_limits``) is sent: the router refuses to
reassemble one, so a sink that sent it would have reported ok for an event no reader applies.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from tokcap.errors import (
    ConfigError,
    EventDecodeError,
    EventTooLargeError,
    InvalidInputError,
    InvalidRolloutIdError,
    NewerSchemaError,
    RecordValidationError,
)
from tokcap.log.checked_puts import accept_put_or_event
from tokcap.log.events import EVENT_SCHEMA_VERSION, Event, PutEvent, StageEvent, encode_event
from tokcap.log.hashing import sha256_hex
from tokcap.log.input_rules import check_entry_fields
from tokcap.log.records import TokenEntry
from tokcap.log.rollout_ids import validate_rollout_id
from transports.kafka.errors import WireDeltaError
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

WIRE_DELTA_SCHEMA_VERSION = 2
"""The message schema of a wire delta; readers that know only schema 1 refuse it as newer."""

_PACKED_MAGIC = b"TKP1"
_DELTA_MAGIC = b"TKD1"
_STAGED_MAGIC = b"TKS1"
_DELTA_PROMPT_FIELD = "prompt_suffix_token_ids"
_ARRAY_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_DELTA_FIELDS = (_DELTA_PROMPT_FIELD, "generation_token_ids", "generation_log_probs")
_TYPECODES = {"<i4": "i", "<i8": "q", "<u8": "Q", "<f8": "d"}
_ID_FIELDS = frozenset({"prompt_token_ids", _DELTA_PROMPT_FIELD, "generation_token_ids"})
_SIGNED_WIDTHS = {"<i4": 4, "<i8": 8}
"""Bytes per value of the signed integer dtypes: the last byte of each value holds its sign bit."""
_LITTLE_ENDIAN = sys.byteorder == "little"


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


def _packed_ids(values: list[int]) -> tuple[str, bytes]:
    """Pack ids in the narrowest dtype that holds them all; an id beyond 64 bits is refused.

    Building the array checks the range itself, which is cheaper than scanning for the minimum and maximum.
    Ids in [2**63, 2**64) (which Gym's digest accepts) go unsigned.
    """
    for dtype in ("<i4", "<i8", "<u8"):
        try:
            return dtype, _pack_array(values, dtype)
        except OverflowError:
            continue
    raise RecordValidationError(f"token ids must fit in 64 bits; found one in [{min(values)}, {max(values)}]")


def _pack_array(values: list[Any], dtype: str) -> bytes:
    packed = array(_TYPECODES[dtype], values)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


_HEAD_FAST_OPTIONS = (
    orjson.OPT_SORT_KEYS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


def _put_mapping_without_dump(event: PutEvent) -> dict[str, Any]:
    """The event's fields as plain values, without pydantic's dump copying the token arrays."""
    entry = dict(event.entry.__dict__)
    if event.entry.__pydantic_extra__:
        entry.update(event.entry.__pydantic_extra__)
    return {
        "entry": entry,
        "rollout_id": event.rollout_id,
        "schema_version": event.schema_version,
        "type": event.type.value,
        "writer": event.writer,
    }


def _unpack_array(data: bytes | memoryview, dtype: str) -> list[Any]:
    if dtype not in _TYPECODES:
        raise EventDecodeError(f"packed put uses unknown dtype {dtype!r}")
    unpacked = array(_TYPECODES[dtype])
    unpacked.frombytes(data)
    if not _LITTLE_ENDIAN:
        unpacked.byteswap()
    return unpacked.tolist()


def _frame(magic: bytes, head: bytes, tail: list[bytes]) -> bytes:
    """A binary value: four magic bytes, the head's length (little-endian u32), the JSON head, then raw bytes."""
    return b"".join([magic, struct.pack("<I", len(head)), head, *tail])


def _read_frame(value: bytes, magic: bytes, what: str) -> tuple[Any, int]:
    """The parsed JSON head of a binary value (``_frame``) and where the bytes after it start."""
    if len(value) < 8 or value[:4] != magic:
        raise EventDecodeError(f"{what} does not start with the {magic.decode()} magic")
    (head_length,) = struct.unpack_from("<I", value, 4)
    head_end = 8 + head_length
    if head_end > len(value):
        raise EventDecodeError(f"{what} is shorter than its header claims")
    try:
        return orjson.loads(value[8:head_end]), head_end
    except orjson.JSONDecodeError as exc:
        raise EventDecodeError(f"{what} header is not valid JSON: {exc}") from exc


def _pack_put(event: PutEvent) -> bytes:
    """The packed value of a put event."""
    return _pack(_PACKED_MAGIC, event, prompt_field="prompt_token_ids", prompt=None, extra_head=None)


def _pack(
    magic: bytes,
    event: PutEvent,
    *,
    prompt_field: str,
    prompt: list[int] | None,
    extra_head: Mapping[str, Any] | None,
    compact: bool = False,
) -> bytes:
    """Head and arrays of a put; ``prompt`` replaces the entry's prompt (a wire delta sends its suffix)."""
    mapping = _put_mapping_without_dump(event)
    entry = mapping["entry"]
    descriptors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name in _ARRAY_FIELDS:
        values = entry.pop(name)
        field_name = name
        if name == "prompt_token_ids":
            field_name = prompt_field
            values = values if prompt is None else prompt
        if name == "generation_log_probs":
            dtype, blob = "<f8", _pack_array(values, "<f8")
        else:
            dtype, blob = _packed_ids(values)
        descriptors.append({"field": field_name, "dtype": dtype, "count": len(values)})
        blobs.append(blob)
    mapping["arrays"] = descriptors
    if extra_head:
        mapping.update(extra_head)
    if compact:
        _without_defaults(entry)
    try:
        head = orjson.dumps(mapping, option=_HEAD_FAST_OPTIONS)
    except TypeError:
        # A value orjson renders differently from pydantic (a datetime extra, say): use pydantic's dump.
        dumped = event.model_dump(mode="json")
        for name in _ARRAY_FIELDS:
            dumped["entry"].pop(name)
        dumped["arrays"] = descriptors
        if extra_head:
            dumped.update(extra_head)
        if compact:
            _without_defaults(dumped["entry"])
        head = orjson.dumps(dumped, option=orjson.OPT_SORT_KEYS)
    return _frame(magic, head, blobs)


def _unpack_put(value: bytes) -> dict[str, Any]:
    """Rebuild the JSON mapping of a packed put event."""
    return _unpack(value, _PACKED_MAGIC, _ARRAY_FIELDS)[0]


def read_packed_head(value: bytes) -> tuple[dict[str, Any], int, int]:
    """A packed put's entry fields without its arrays, its prompt and generation count, and where its arrays start.

    For a reader that leaves the arrays undecoded (the lineage resolver). The ids are checked on their
    bytes and the other fields by the input rules (``check_entry_fields``); the rules that need the
    decoded arrays (finite log probs, equal lengths) are applied when a put is decoded whole, which such a
    reader does before using one.
    """
    mapping, head_end, counts = _unpack(value, _PACKED_MAGIC, _ARRAY_FIELDS, decode=False)
    if mapping.get("type") != "put":
        raise EventDecodeError(f"a packed value must be a put event, got {mapping.get('type')!r}")
    entry = mapping["entry"]
    try:
        check_entry_fields(entry)
    except InvalidInputError as exc:
        raise _refused(exc) from exc
    return entry, counts["prompt_token_ids"] + counts["generation_token_ids"], head_end


def _unpack(
    value: bytes, magic: bytes, fields: tuple[str, ...], *, decode: bool = True
) -> tuple[dict[str, Any], int, dict[str, int]]:
    """The head of a packed value with its arrays put back into ``entry`` under their field names.

    Also return where the arrays start and each array's length. Id arrays are checked on their bytes
    (``_check_packed_ids``); without ``decode`` no array is decoded and ``entry`` holds none.
    """
    mapping, head_end = _read_frame(value, magic, "packed put value")
    if not isinstance(mapping, dict) or not isinstance(mapping.get("entry"), dict):
        raise EventDecodeError("packed put header must be an object with an entry object")
    if isinstance(mapping.get("schema_version"), int) and mapping["schema_version"] > EVENT_SCHEMA_VERSION:
        raise NewerSchemaError(
            f"event schema_version {mapping['schema_version']} is newer than {EVENT_SCHEMA_VERSION}; "
            "upgrade tokcap on the reader"
        )
    descriptors = mapping.pop("arrays", None)
    if not isinstance(descriptors, list) or [
        d.get("field") for d in descriptors if isinstance(d, dict)
    ] != list(fields):
        raise EventDecodeError(f"packed put header must describe the arrays {list(fields)} in order")
    entry = mapping["entry"]
    cursor = head_end
    counts: dict[str, int] = {}
    view = memoryview(value)
    for descriptor in descriptors:
        dtype, count, field = descriptor.get("dtype"), descriptor.get("count"), descriptor["field"]
        if dtype not in _TYPECODES or not isinstance(count, int) or count < 0:
            raise EventDecodeError(f"packed put array descriptor {descriptor!r} is invalid")
        size = count * (4 if dtype == "<i4" else 8)
        if cursor + size > len(value):
            raise EventDecodeError(f"packed put value is truncated inside array {field}")
        if field in _ID_FIELDS:
            _check_packed_ids(mapping, field, dtype, value, cursor, cursor + size)
        if decode:
            entry[field] = _unpack_array(view[cursor : cursor + size], dtype)
        else:
            entry.pop(field, None)
        counts[field] = count
        cursor += size
    if cursor != len(value):
        raise EventDecodeError(f"packed put value has {len(value) - cursor} trailing bytes")
    return dict(mapping), head_end, counts


def _check_packed_ids(
    mapping: Mapping[str, Any], field: str, dtype: str, value: bytes, start: int, end: int
) -> None:
    """Refuse a packed id array (``value[start:end]``) a sink could not have sent: ids are ints in [0, 2**64).

    A float dtype is refused outright. A little-endian signed value is negative exactly when the top bit of
    its last byte is set, so an array holds no negative id exactly when those bytes are all ASCII: one
    strided slice and ``isascii``, both in C, a small fraction of the cost of decoding the array.
    """
    width = _SIGNED_WIDTHS.get(dtype)
    if dtype == "<u8" or (width is not None and value[start + width - 1 : end : width].isascii()):
        return
    why = f"is packed as {dtype}, not as integers" if width is None else "holds a negative token id"
    entry = mapping.get("entry") or {}
    raise EventDecodeError(
        f"refused by the input rules: rollout {mapping.get('rollout_id')!r} call {entry.get('model_call_id')!r}: "
        f"{field} {why}; token ids are integers in [0, 2**64)"
    )


def _refused(exc: InvalidInputError) -> EventDecodeError:
    """A refusal by the sinks' input rules as an ``EventDecodeError`` that names the field.

    Every reader then dead-letters the message, or passes over it, as it does any message it cannot apply.
    (Plain ``try`` blocks call this rather than a context manager, which would cost a microsecond per event.)
    """
    return EventDecodeError(
        f"refused by the input rules: {exc}", rollout_id=exc.rollout_id, model_call_id=exc.model_call_id
    )


def _accepted(raw: object, *, token_ids_checked: bool) -> Event:
    """The event decoded JSON stands for, if it passes the sinks' input rules (``accept_put_or_event``)."""
    try:
        return accept_put_or_event(raw, token_ids_checked=token_ids_checked)
    except (EventDecodeError, NewerSchemaError):
        raise
    except InvalidInputError as exc:
        raise _refused(exc) from exc


def _pack_stage(event: StageEvent) -> bytes:
    """The ``staged`` value of a stage event: its JSON, then the bytes of every blob it names."""
    head = encode_event(event)
    carried = event.blob_bytes
    blobs = []
    for ref in event.blob_refs():
        data = carried.get(ref.sha256)
        if data is None:
            raise InvalidInputError(
                f"stage of {event.staging_key!r} names blob {ref.sha256} but does not carry its bytes; "
                "a run topic must hold every staged byte",
                rollout_id=event.rollout_id,
                model_call_id=event.model_call_id,
            )
        blobs.append(data)
    return _frame(_STAGED_MAGIC, head, blobs)


def _unpack_stage(value: bytes) -> StageEvent:
    """A stage event with the blob bytes it carries, each checked against the size and SHA-256 its row names."""
    raw, head_end = _read_frame(value, _STAGED_MAGIC, "staged value")
    event = _accepted(raw, token_ids_checked=False)
    if not isinstance(event, StageEvent):
        raise EventDecodeError(f"a staged value must be a stage event, got {event.type.value}")
    blobs: dict[str, bytes] = {}
    cursor = head_end
    for ref in event.blob_refs():
        data = value[cursor : cursor + ref.size]
        if len(data) != ref.size:
            raise EventDecodeError(
                f"staged value of {event.staging_key!r} is truncated inside blob {ref.sha256}"
            )
        if sha256_hex(data) != ref.sha256:
            raise EventDecodeError(
                f"a blob of {event.staging_key!r} does not match the SHA-256 {ref.sha256} its row names"
            )
        blobs[ref.sha256] = data
        cursor += ref.size
    if cursor != len(value):
        raise EventDecodeError(
            f"staged value of {event.staging_key!r} has {len(value) - cursor} trailing bytes"
        )
    return event.with_blob_bytes(blobs)


@dataclass(frozen=True)
class ParentLink:
    """Where a wire delta's prompt prefix was sent: the parent put's message and what it holds.

    ``length`` is the number of tokens of the parent's prompt plus generation, the child prompt's prefix.
    """

    partition: int
    offset: int
    model_call_id: str
    length: int


@dataclass(frozen=True)
class WireDelta:
    """A decoded wire delta: the put without its prompt prefix, and the digest that proves the restored entry."""

    mapping: dict[str, Any]
    link: ParentLink
    entry_digest: str
    """sha256 of the original entry's canonical JSON (``TokenEntry.payload_digest``), prompt included."""
    suffix: list[int]

    @property
    def rollout_id(self) -> Any:
        """The rollout the delta's head names (checked against the key when decoded)."""
        return self.mapping.get("rollout_id")

    @property
    def model_call_id(self) -> Any:
        """The call the delta carries."""
        return self.mapping["entry"].get("model_call_id")

    @property
    def prompt_count(self) -> int:
        """Tokens of the restored prompt."""
        return self.link.length + len(self.suffix)

    def check_head(self) -> None:
        """Refuse the entry's fields other than its arrays by the input rules (``check_entry_fields``).

        For a reader that does not restore the delta (the lineage resolver); the arrays' ids were checked on
        their bytes when the delta was decoded.
        """
        try:
            check_entry_fields({k: v for k, v in self.mapping["entry"].items() if k not in _DELTA_FIELDS})
        except InvalidInputError as exc:
            raise _refused(exc) from exc

    def restore(self, prefix: list[int]) -> PutEvent:
        """The exact put the sink was given: ``prefix`` (the parent's prompt and generation) then the suffix.

        Raise ``WireDeltaError`` when the prefix has the wrong length or the restored entry's canonical bytes
        do not match the digest the sink computed over the original entry: it is never applied wrong.
        """
        if len(prefix) != self.link.length:
            raise WireDeltaError(
                f"parent {self.link.model_call_id!r} at offset {self.link.offset} holds {len(prefix)} tokens, "
                f"the delta was cut after {self.link.length}"
            )
        # The head and the suffix are validated and checked by the input rules (the ids on their bytes, when
        # the delta was decoded). The prefix is the parent's prompt and generation, which passed them when the
        # parent was decoded, so it is put in afterwards instead of being checked again. No rule of an entry
        # depends on its prompt beyond each id being one in range, and the digest below proves the whole
        # restored entry is the one the sink sent.
        mapping = dict(self.mapping)
        mapping["entry"] = {**self.mapping["entry"], "prompt_token_ids": self.suffix}
        event = _accepted(mapping, token_ids_checked=True)
        if not isinstance(event, PutEvent):
            raise EventDecodeError(f"a wire delta must be a put event, got {event.type.value}")
        event.entry.__dict__["prompt_token_ids"] = prefix + self.suffix
        if event.payload_digest != self.entry_digest:
            raise WireDeltaError(
                f"the entry restored from parent {self.link.model_call_id!r} at offset {self.link.offset} "
                "does not match the digest of the entry the sink sent"
            )
        return event


def _entry_defaults() -> dict[str, Any]:
    """Every optional entry field's default: a wire delta leaves out the fields that hold it."""
    return {
        name: info.get_default(call_default_factory=True)
        for name, info in TokenEntry.model_fields.items()
        if not info.is_required()
    }


_ENTRY_DEFAULTS = _entry_defaults()


def _without_defaults(entry: dict[str, Any]) -> None:
    """Drop fields equal to their default, with the default's type (validation puts them back identical)."""
    for name, default in _ENTRY_DEFAULTS.items():
        if name in entry and type(entry[name]) is type(default) and entry[name] == default:
            del entry[name]


def encode_delta_message(
    event: PutEvent, link: ParentLink, *, entry_digest: str | None = None
) -> OutgoingMessage:
    """The one message that sends a put as (parent link, prompt suffix); it is pinned to the parent's partition.

    The caller proved that the prompt starts with the parent's ``link.length`` tokens. Fields holding their
    default are left out; the entry's digest lets the reader prove its restored entry is the one sent.
    """
    prompt = event.entry.prompt_token_ids
    extra = {
        "entry_sha256": entry_digest or event.entry.payload_digest(),
        "parent": {
            "length": link.length,
            "model_call_id": link.model_call_id,
            "offset": link.offset,
            "partition": link.partition,
        },
    }
    value = _pack(
        _DELTA_MAGIC,
        event,
        prompt_field=_DELTA_PROMPT_FIELD,
        prompt=prompt[link.length :],
        extra_head=extra,
        compact=True,
    )
    headers = [
        (HEADER_TYPE, event.type.value.encode()),
        (HEADER_SCHEMA, str(WIRE_DELTA_SCHEMA_VERSION).encode()),
        (HEADER_WRITER, event.writer.encode()),
        (HEADER_ENCODING, ENCODING_DELTA.encode()),
    ]
    return OutgoingMessage(event.rollout_id.encode(), value, headers, partition=link.partition)


def is_wire_delta(headers: Mapping[str, str]) -> bool:
    """Whether a message is a wire delta, which only a reader holding its parent can decode."""
    return headers.get(HEADER_ENCODING) == ENCODING_DELTA


def decode_wire_delta(key: bytes | None, value: bytes | None, headers: Mapping[str, str]) -> WireDelta:
    """Decode a wire delta's head and arrays; restoring it needs the parent (``WireDelta.restore``).

    Raise ``EventDecodeError`` (``NewerSchemaError`` for a newer schema) with the reason to dead-letter it.
    """
    schema = headers.get(HEADER_SCHEMA)
    if schema != str(WIRE_DELTA_SCHEMA_VERSION):
        if schema is not None and schema.isdigit() and int(schema) > WIRE_DELTA_SCHEMA_VERSION:
            raise NewerSchemaError(
                f"newer schema: wire delta schema_version {schema} is newer than {WIRE_DELTA_SCHEMA_VERSION}; "
                "upgrade tokcap on the reader"
            )
        raise EventDecodeError(
            f"undecodable event: a wire delta must have schema_version {WIRE_DELTA_SCHEMA_VERSION}"
        )
    if value is None:
        raise EventDecodeError("message has no value")
    try:
        mapping = _unpack(value, _DELTA_MAGIC, _DELTA_FIELDS)[0]
        parent, digest = mapping.pop("parent", None), mapping.pop("entry_sha256", None)
        if not isinstance(parent, dict):
            raise EventDecodeError("a wire delta head must carry its parent link")
        link = ParentLink(
            partition=_strict_int(parent.get("partition"), "parent partition"),
            offset=_strict_int(parent.get("offset"), "parent offset"),
            model_call_id=_strict_str(parent.get("model_call_id"), "parent call id"),
            length=_strict_int(parent.get("length"), "parent length"),
        )
        suffix = mapping["entry"].pop(_DELTA_PROMPT_FIELD)
        delta = WireDelta(
            mapping=mapping,
            link=link,
            entry_digest=_strict_str(digest, "entry digest"),
            suffix=suffix,
        )
    except EventDecodeError as exc:
        raise EventDecodeError(f"undecodable event: {exc}") from exc
    if key is None or key != str(delta.rollout_id).encode() or rollout_of_key(key) is None:
        raise EventDecodeError(f"key {key!r} does not match the event's rollout {delta.rollout_id!r}")
    return delta


def _strict_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise EventDecodeError(f"wire delta {what} must be a non-negative integer, got {value!r}")
    return value


def _strict_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise EventDecodeError(f"wire delta {what} must be a string, got {value!r}")
    return value


def encode_event_value(event: Event) -> tuple[str, bytes]:
    """The value bytes of an event and the name of their encoding."""
    if isinstance(event, PutEvent):
        return ENCODING_PACKED, _pack_put(event)
    if isinstance(event, StageEvent):
        return ENCODING_STAGED, _pack_stage(event)
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
        event = _accepted(_unpack_put(value), token_ids_checked=True)
        if not isinstance(event, PutEvent):
            raise EventDecodeError(f"a packed value must be a put event, got {event.type.value}")
        return event
    if encoding == ENCODING_STAGED:
        return _unpack_stage(value)
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
    event = _accepted(raw, token_ids_checked=False)
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


def rollout_of_key(key: bytes | None) -> str | None:
    """The rollout id a message key names, or ``None`` when the key is not a valid id."""
    if key is None:
        return None
    try:
        return validate_rollout_id(key.decode())
    except (UnicodeDecodeError, InvalidRolloutIdError):
        return None

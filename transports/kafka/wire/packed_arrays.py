"""The ``packed`` value of a put: its token arrays as binary, so a long prompt stays small.

Layout (``binary_frame``, magic ``TKP1``): the event's JSON without the three arrays (which instead lists
each array's dtype and count), then the arrays' bytes in that order. Ids are ``<i4`` when they fit, else
``<i8``; log probs are ``<f8``, so every value round-trips exactly. Ids beyond 64 bits are refused (the
canonical JSON encoder cannot write them either). A packed id array must use an integer dtype and hold no
negative value; that is checked on its bytes, before it is decoded. A wire delta (``deltas``) packs its
prompt suffix the same way under its own magic.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from typing import Any

import orjson

from tokcap.errors import EventDecodeError, InvalidInputError, NewerSchemaError, RecordValidationError
from tokcap.log.events import EVENT_SCHEMA_VERSION, PutEvent
from tokcap.log.input_rules import check_entry_fields
from tokcap.log.records import TokenEntry
from transports.kafka.wire.binary_frame import frame, read_frame
from transports.kafka.wire.input_refusals import refused

__all__ = [
    "ARRAY_FIELDS",
    "DELTA_PROMPT_FIELD",
    "pack_arrays",
    "pack_put",
    "read_packed_head",
    "unpack_arrays",
    "unpack_put",
]

_PACKED_MAGIC = b"TKP1"
DELTA_PROMPT_FIELD = "prompt_suffix_token_ids"
"""The array a wire delta packs its prompt suffix under; its ids are checked as any prompt's."""
ARRAY_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""A packed put's arrays, in the order its head describes them and its bytes hold them."""
_TYPECODES = {"<i4": "i", "<i8": "q", "<u8": "Q", "<f8": "d"}
_ID_FIELDS = frozenset({"prompt_token_ids", DELTA_PROMPT_FIELD, "generation_token_ids"})
_SIGNED_WIDTHS = {"<i4": 4, "<i8": 8}
"""Bytes per value of the signed integer dtypes: the last byte of each value holds its sign bit."""
_LITTLE_ENDIAN = sys.byteorder == "little"


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


def pack_put(event: PutEvent) -> bytes:
    """The packed value of a put event."""
    return pack_arrays(_PACKED_MAGIC, event, prompt_field="prompt_token_ids", prompt=None, extra_head=None)


def pack_arrays(
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
    for name in ARRAY_FIELDS:
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
        for name in ARRAY_FIELDS:
            dumped["entry"].pop(name)
        dumped["arrays"] = descriptors
        if extra_head:
            dumped.update(extra_head)
        if compact:
            _without_defaults(dumped["entry"])
        head = orjson.dumps(dumped, option=orjson.OPT_SORT_KEYS)
    return frame(magic, head, blobs)


def unpack_put(value: bytes) -> dict[str, Any]:
    """Rebuild the JSON mapping of a packed put event."""
    return unpack_arrays(value, _PACKED_MAGIC, ARRAY_FIELDS)[0]


def read_packed_head(value: bytes) -> tuple[dict[str, Any], int, int]:
    """A packed put's entry fields without its arrays, its prompt and generation count, and where its arrays start.

    For a reader that leaves the arrays undecoded (the lineage resolver). The ids are checked on their
    bytes and the other fields by the input rules (``check_entry_fields``); the rules that need the
    decoded arrays (finite log probs, equal lengths) are applied when a put is decoded whole, which such a
    reader does before using one.
    """
    mapping, head_end, counts = unpack_arrays(value, _PACKED_MAGIC, ARRAY_FIELDS, decode=False)
    if mapping.get("type") != "put":
        raise EventDecodeError(f"a packed value must be a put event, got {mapping.get('type')!r}")
    entry = mapping["entry"]
    try:
        check_entry_fields(entry)
    except InvalidInputError as exc:
        raise refused(exc) from exc
    return entry, counts["prompt_token_ids"] + counts["generation_token_ids"], head_end


def unpack_arrays(
    value: bytes, magic: bytes, fields: tuple[str, ...], *, decode: bool = True
) -> tuple[dict[str, Any], int, dict[str, int]]:
    """The head of a packed value with its arrays put back into ``entry`` under their field names.

    Also return where the arrays start and each array's length. Id arrays are checked on their bytes
    (``_check_packed_ids``); without ``decode`` no array is decoded and ``entry`` holds none.
    """
    mapping, head_end = read_frame(value, magic, "packed put value")
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

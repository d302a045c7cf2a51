"""Puts checked and built without pydantic on the hot path: a sink's put encoded once, a reader's put built once.

Every put passes the input rules (``tokcap.log.input_rules``) and becomes a ``PutEvent`` whose canonical line and
digest decide its verdict. Pydantic's validation and the rules' separate scans walk the same token arrays
several times. The functions here do the common case in one pass of exact-type checks, with the token ids
checked on their orjson encoding, and build the models with ``model_construct``-equivalent assignment.

They prove acceptance; they never refuse. Whenever a value is not of the exact type a validated entry holds
(an int log prob, a subclass, a tuple, a non-finite float, an unknown event field) or a rule fails, they hand
the put to the reference door (``accept_entry`` and ``PutEvent(...)`` for a sink, ``accept_event`` for a
reader), which refuses it with the same error class and message as always, or accepts it the slow way. So the
refusals are the reference's by construction, and the bytes are the same: the canonical line is orjson's
encoding of the same values, with the id arrays inserted as the text that was checked (``orjson.Fragment``).
``tests/unit/test_checked_puts.py`` holds both paths equal over random entries.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import orjson

from tokcap.errors import InvalidInputError
from tokcap.log.events import EVENT_SCHEMA_VERSION, Event, EventType, PutEvent
from tokcap.log.hashing import sha256_hex
from tokcap.log.input_rules import accept_entry, accept_event, check_call_id, check_finite_values
from tokcap.log.records import (
    TOKEN_ENTRY_MIN_SCHEMA_VERSION,
    TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    ParentResolutionStatus,
    TokenEntry,
)

__all__ = ["accept_put", "accept_put_or_event"]

_LINE_OPTIONS = (
    orjson.OPT_SORT_KEYS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)
"""``TokenEntry.canonical_json``'s options: a value orjson would render differently from pydantic is refused."""

_ID_TEXT_BYTES = b"0123456789,[]"
"""The only bytes orjson writes for a list of ints in [0, 2**64) (see ``input_rules._check_token_ids``)."""

_RESOLUTIONS = {member.value: member for member in ParentResolutionStatus}

_NONE = type(None)

_SCALARS: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "response_id": (str, _NONE),
    "parent_call_id": (str, _NONE),
    "cum_len": (int, _NONE),
    "digest": (str, _NONE),
    "continuation_fingerprint": (str,),
    "continuation_context_len": (int,),
    "continuation_context_digest": (str,),
    "parent_resolution_reason": (str,),
    "fingerprint_version": (int, _NONE),
    "prompt_is_delta": (bool,),
    "prefix_requested": (bool,),
    "prefix_supplied": (bool,),
}
"""Entry fields a validated entry holds as given when they have one of these exact types."""

_FIELD_DEFAULTS: dict[str, Any] = {
    name: info.get_default(call_default_factory=False)
    for name, info in TokenEntry.model_fields.items()
    if not info.is_required() and name != "output_items"
}
"""Every optional field's default but ``output_items``, whose default is a new list each time; in field order."""

_FIELDS = frozenset(TokenEntry.model_fields)

_EVENT_KEYS = frozenset({"schema_version", "rollout_id", "writer", "type", "entry"})


def _ids_text(ids: object) -> bytes | None:
    """orjson's encoding of a list of ids in [0, 2**64), or ``None`` when the list may hold anything else.

    A bool is written ``true``/``false``, a negative id with ``-``, a float with ``.`` or ``e``; an int
    subclass other than an enum is refused by ``OPT_PASSTHROUGH_SUBCLASS``, as the canonical encode refuses it.
    """
    if type(ids) is not list:
        return None
    try:
        text = orjson.dumps(ids, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError:
        return None
    return None if text.translate(None, _ID_TEXT_BYTES) else text


def _floats_finite(values: object) -> bool:
    """Whether ``values`` is a list of exact, finite floats: what validation gives and the rules accept."""
    if type(values) is not list:
        return False
    return list(map(type, values)).count(float) == len(values) and math.isfinite(sum(values))


def _rules_pass(entry_values: dict[str, Any], extras: dict[str, Any]) -> bool:
    """Whether the rules ``check_storable`` applies after the arrays pass: call id, finite nested values."""
    rollout_id, call_id = entry_values["rollout_id"], entry_values["model_call_id"]
    try:
        check_call_id(rollout_id, call_id)
        check_finite_values(rollout_id, call_id, "output_items", entry_values["output_items"])
        check_finite_values(rollout_id, call_id, "routed_experts", entry_values["routed_experts"])
        for name, value in extras.items():
            check_finite_values(rollout_id, call_id, name, value)
    except InvalidInputError:
        return False
    return True


def _line(
    values: dict[str, Any], extras: dict[str, Any], prompt_text: bytes, generation_text: bytes
) -> bytes | None:
    """The entry's canonical line with its id arrays given as their checked text; ``None`` if orjson refuses."""
    fields = dict(values)
    if extras:
        fields.update(extras)
    fields["prompt_token_ids"] = orjson.Fragment(prompt_text)
    fields["generation_token_ids"] = orjson.Fragment(generation_text)
    resolution = fields["parent_resolution"]
    if isinstance(resolution, Enum):
        fields["parent_resolution"] = resolution.value
    try:
        return orjson.dumps(fields, option=_LINE_OPTIONS)
    except TypeError:
        return None


def _put_event(
    entry: TokenEntry, schema_version: int, writer: str, fields_set: set[str], line: bytes | None
) -> PutEvent:
    """A ``PutEvent`` exactly as validation builds it from these already checked values; its line kept once."""
    event = PutEvent.__new__(PutEvent)
    values: dict[str, Any] = {
        "schema_version": schema_version,
        "rollout_id": entry.rollout_id,
        "writer": writer,
        "type": EventType.PUT,
        "entry": entry,
    }
    object.__setattr__(event, "__dict__", values)
    object.__setattr__(event, "__pydantic_private__", None)
    object.__setattr__(event, "__pydantic_extra__", None)
    object.__setattr__(event, "__pydantic_fields_set__", fields_set)
    if line is not None:
        # The cached properties' own slots: what ``entry_line`` and ``payload_digest`` would compute.
        values["entry_line"] = line
        values["payload_digest"] = sha256_hex(line)
    return event


def accept_put(entry: object, writer: str = "") -> PutEvent:
    """The put event of an entry a sink was given, checked by the input rules, its canonical line encoded once.

    A tokcap ``TokenEntry`` of plain values takes the one-pass check; anything else (a Gym entry, a mapping,
    a value the pass cannot prove) goes through ``accept_entry`` and a validated ``PutEvent``, which refuse
    exactly as they always have.
    """
    if type(entry) is TokenEntry:
        event = _sink_put(entry, writer)
        if event is not None:
            return event
    checked = accept_entry(entry)
    if writer:
        return PutEvent(rollout_id=checked.rollout_id, writer=writer, entry=checked)
    return PutEvent(rollout_id=checked.rollout_id, entry=checked)


def _sink_put(entry: TokenEntry, writer: str) -> PutEvent | None:
    """``accept_put``'s one pass over a tokcap entry, or ``None`` when the reference door must decide."""
    values = entry.__dict__
    if type(values["rollout_id"]) is not str or type(values["model_call_id"]) is not str:
        return None
    prompt_text = _ids_text(values["prompt_token_ids"])
    generation_text = _ids_text(values["generation_token_ids"])
    if prompt_text is None or generation_text is None:
        return None
    created_at = values["created_at"]
    if not _floats_finite(values["generation_log_probs"]) or type(created_at) is not float:
        return None
    if not math.isfinite(created_at) or entry.__pydantic_private__:
        return None
    extras = entry.__pydantic_extra__ or {}
    if not _rules_pass(values, extras):
        return None
    line = _line(values, extras, prompt_text, generation_text)
    fields_set = {"rollout_id", "entry", "writer"} if writer else {"rollout_id", "entry"}
    return _put_event(entry, EVENT_SCHEMA_VERSION, writer, fields_set, line)


def accept_put_or_event(raw: object, *, token_ids_checked: bool) -> Event:
    """``accept_event`` for decoded JSON, with a put whose token ids the caller checked built in one pass.

    ``token_ids_checked`` has ``accept_event``'s meaning, and more: the id lists are lists of exact ints, as
    a packed array's ``tolist`` gives them. Anything the pass cannot prove goes to ``accept_event``.
    """
    if token_ids_checked and type(raw) is dict and raw.get("type") == "put":
        event = _reader_put(raw)
        if event is not None:
            return event
    return accept_event(raw, token_ids_checked=token_ids_checked)


def _reader_put(raw: dict[str, Any]) -> PutEvent | None:
    """``accept_put_or_event``'s one pass over a decoded put, or ``None`` when ``accept_event`` must decide."""
    if not raw.keys() <= _EVENT_KEYS or type(raw["type"]) is not str:
        return None
    schema_version = raw.get("schema_version", EVENT_SCHEMA_VERSION)
    writer = raw.get("writer", "")
    rollout_id = raw.get("rollout_id")
    given = raw.get("entry")
    if type(schema_version) is not int or schema_version > EVENT_SCHEMA_VERSION or type(writer) is not str:
        return None
    if type(rollout_id) is not str or type(given) is not dict:
        return None
    entry = _entry_of(given, rollout_id)
    if entry is None:
        return None
    return _put_event(entry, schema_version, writer, set(raw), None)


def _entry_of(given: dict[str, Any], rollout_id: str) -> TokenEntry | None:
    """The entry validation would build from ``given`` (decoded JSON), if every rule passes; else ``None``."""
    values = dict(_FIELD_DEFAULTS)
    extras: dict[str, Any] = {}
    for name, value in given.items():
        if name in _FIELDS:
            values[name] = value
        else:
            extras[name] = value
    if "output_items" not in given:
        values["output_items"] = []
    if not _entry_values_valid(values, rollout_id):
        return None
    resolution = values["parent_resolution"]
    if resolution is not None:
        values["parent_resolution"] = _RESOLUTIONS[resolution]
    if not _rules_pass(values, extras):
        return None
    entry = TokenEntry.__new__(TokenEntry)
    object.__setattr__(entry, "__dict__", {name: values[name] for name in TokenEntry.model_fields})
    object.__setattr__(entry, "__pydantic_private__", None)
    object.__setattr__(entry, "__pydantic_extra__", extras)
    object.__setattr__(entry, "__pydantic_fields_set__", set(given))
    return entry


def _entry_values_valid(values: dict[str, Any], rollout_id: str) -> bool:
    """Whether validation would keep these values as they are and its invariants and the rules' checks pass."""
    version = values["schema_version"]
    if (
        type(version) is not int
        or not TOKEN_ENTRY_MIN_SCHEMA_VERSION <= version <= TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    ):
        return False
    if values.get("rollout_id") != rollout_id or type(values.get("model_call_id")) is not str:
        return False
    prompt, generation = values.get("prompt_token_ids"), values.get("generation_token_ids")
    log_probs = values.get("generation_log_probs")
    if type(prompt) is not list or type(generation) is not list or not _floats_finite(log_probs):
        return False
    assert isinstance(log_probs, list)
    if len(generation) != len(log_probs):
        return False
    created_at = values["created_at"]
    if type(created_at) is not float or not math.isfinite(created_at):
        return False
    for name, kinds in _SCALARS.items():
        if type(values[name]) not in kinds:
            return False
    items, index = values["output_items"], values["token_item_index"]
    if type(items) is not list or any(type(item) is not dict for item in items):
        return False
    if index is not None and (type(index) is not int or not 0 <= index < len(items)):
        return False
    resolution, parent = values["parent_resolution"], values["parent_call_id"]
    if resolution is not None and (type(resolution) is not str or resolution not in _RESOLUTIONS):
        return False
    if resolution == ParentResolutionStatus.RESOLVED:
        return bool(parent)
    if resolution is not None and parent is not None:
        return False
    return not values["prompt_is_delta"]

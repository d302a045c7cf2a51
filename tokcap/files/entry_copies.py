"""An entry's copy that is exactly what a fresh read of its stored line gives, without parsing the line.

Parsing a stored line costs about 160 us per 3k-token entry (orjson, then pydantic). A freeze answered from
memory (the materializer's ``Projection``, the file store's ``KeptEntries``) already holds the decoded entries
of its rollout, so it copies them instead.
A copy is made only when it is exactly what the parse gives: every value of a JSON type (``str``, ``int``,
``float``, ``bool``, ``None``, ``list``, ``dict`` with ``str`` keys, copied in sorted key order as the store
writes them), every declared field of the type the parse gives it, and every field set. Anything else (a tuple,
an enum, a subclass, an unknown field, ``routed_experts``, which can be millions of values) gets ``None``, and
the caller parses the line. The copy shares nothing mutable with the original.
"""

from __future__ import annotations

from typing import Any

from tokcap.log.records import ParentResolutionStatus, TokenEntry

__all__ = ["fresh_read_copy"]


class _NotExact(Exception):
    """A value a fresh read of its JSON would not give back as is."""


def _json_copy(value: Any) -> Any:
    """A deep copy of a JSON value as orjson reads it back: dict keys sorted, as the store writes them."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is list:
        return [_json_copy(item) for item in value]
    if kind is dict:
        if any(type(key) is not str for key in value):
            raise _NotExact
        return {key: _json_copy(value[key]) for key in sorted(value)}
    raise _NotExact


def _holds_only(values: Any, kind: type) -> bool:
    """Whether ``values`` is a list of exactly ``kind`` (no bool for int, no subclass); one C pass."""
    return type(values) is list and list(map(type, values)).count(kind) == len(values)


_NONE = type(None)

_SCALAR_TYPES: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("schema_version", (int,)),
    ("rollout_id", (str,)),
    ("model_call_id", (str,)),
    ("model", (str,)),
    ("routed_experts", (_NONE,)),
    ("token_item_index", (int, _NONE)),
    ("response_id", (str, _NONE)),
    ("created_at", (float,)),
    ("parent_call_id", (str, _NONE)),
    ("cum_len", (int, _NONE)),
    ("digest", (str, _NONE)),
    ("parent_resolution", (ParentResolutionStatus, _NONE)),
    ("continuation_fingerprint", (str,)),
    ("continuation_context_len", (int,)),
    ("continuation_context_digest", (str,)),
    ("parent_resolution_reason", (str,)),
    ("fingerprint_version", (int, _NONE)),
    ("prompt_is_delta", (bool,)),
    ("prefix_requested", (bool,)),
    ("prefix_supplied", (bool,)),
)
"""The type a fresh read gives each scalar field (``routed_experts`` is kept only when absent)."""

_LISTS: tuple[tuple[str, type], ...] = (
    ("prompt_token_ids", int),
    ("generation_token_ids", int),
    ("generation_log_probs", float),
)
"""The token arrays and the one type their elements read back as."""

_FIELDS = frozenset({name for name, _ in _SCALAR_TYPES} | {name for name, _ in _LISTS} | {"output_items"})
"""Every declared field of ``TokenEntry``; an entry with any other field is not kept."""


def fresh_read_copy(entry: TokenEntry, *, arrays_exact: bool = False) -> TokenEntry | None:
    """A copy of ``entry`` equal in every detail to what parsing its canonical line gives; ``None`` when some
    value would read back differently (the caller then parses the line).

    ``arrays_exact`` skips checking the type of every token and log prob, the costliest step of a copy (about
    30 us for a 3k-token list). Only a caller that built the entry itself may pass it: pydantic's validation
    and a packed array's ``tolist`` give lists of exact ints and floats, and they stay so while nothing else
    holds the entry. Each array must still be a list.
    """
    values = entry.__dict__
    if values.keys() != _FIELDS or entry.__pydantic_private__:
        return None
    for name, kinds in _SCALAR_TYPES:
        if type(values[name]) not in kinds:
            return None
    copied = dict(values)
    for name, kind in _LISTS:
        sequence = values[name]
        if type(sequence) is not list or not (arrays_exact or _holds_only(sequence, kind)):
            return None
        copied[name] = list(sequence)
    items = values["output_items"]
    if type(items) is not list or any(type(item) is not dict for item in items):
        return None
    extra = entry.__pydantic_extra__ or {}
    try:
        copied["output_items"] = _json_copy(items)
        extras = {name: _json_copy(extra[name]) for name in sorted(extra)}
    except _NotExact:
        return None
    return _built(copied, extras)


def _built(values: dict[str, Any], extras: dict[str, Any]) -> TokenEntry:
    """An entry from already checked values, with the fields-set a parse of its line gives (every key)."""
    built = TokenEntry.__new__(TokenEntry)
    object.__setattr__(built, "__dict__", values)
    object.__setattr__(built, "__pydantic_private__", None)
    object.__setattr__(built, "__pydantic_extra__", extras)
    object.__setattr__(built, "__pydantic_fields_set__", {*values, *extras})
    return built

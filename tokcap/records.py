"""The training-token record: one ``TokenEntry`` per model call.

A record holds the exact prompt token ids, generated token ids and their log
probabilities of one call, plus the assistant content without the arrays.
Its canonical JSON (keys sorted, orjson) is what the store writes and what
digests are computed over, so two processes agree on "the same payload".
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from tokcap.errors import NewerSchemaError, RecordValidationError, TokenExtractionError

__all__ = [
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "ExtractedTokenFields",
    "TokenEntry",
    "entry_digest",
    "extract_token_fields",
    "response_items",
    "strip_token_fields",
]

TOKEN_ENTRY_RECORD_SCHEMA_VERSION = 1
"""The newest record schema this reader understands; newer records are refused."""

TOKEN_FIELDS: tuple[str, ...] = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""Token arrays a model response item carries; all or none of them must be present."""

_OPTIONAL_TOKEN_FIELDS: tuple[str, ...] = ("routed_experts",)

_CANONICAL_FAST_OPTIONS = (
    orjson.OPT_SORT_KEYS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


def _refuse_newer_schema(version: object, what: str) -> None:
    """Fail loudly on a record from a newer writer: skipping it would silently lose a turn."""
    if isinstance(version, int) and version > TOKEN_ENTRY_RECORD_SCHEMA_VERSION:
        raise NewerSchemaError(
            f"{what} has schema_version {version}, but this reader knows only up to "
            f"{TOKEN_ENTRY_RECORD_SCHEMA_VERSION}; upgrade tokcap on the reading side"
        )


class TokenEntry(BaseModel):
    """One model call's training tokens, keyed by rollout id and model call id."""

    model_config = ConfigDict(extra="allow", validate_assignment=False)

    schema_version: StrictInt = TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[StrictInt]
    generation_token_ids: list[StrictInt]
    generation_log_probs: list[float] = Field(default_factory=list)
    routed_experts: Any = None
    output_items: list[dict[str, Any]] = Field(default_factory=list)
    token_item_index: int | None = None
    created_at: float = Field(default_factory=time.time)

    @model_validator(mode="before")
    @classmethod
    def _check_schema_first(cls, data: Any) -> Any:
        """Refuse a newer schema before anything else can fail with a less useful message."""
        if isinstance(data, Mapping):
            version = data.get("schema_version", TOKEN_ENTRY_RECORD_SCHEMA_VERSION)
            if isinstance(version, int) and version > TOKEN_ENTRY_RECORD_SCHEMA_VERSION:
                raise ValueError(
                    f"record schema_version {version} is newer than {TOKEN_ENTRY_RECORD_SCHEMA_VERSION}; "
                    "upgrade tokcap on the reading side"
                )
        return data

    @model_validator(mode="after")
    def _check_invariants(self) -> TokenEntry:
        """A record whose arrays disagree cannot be trained on; refuse it at the door."""
        if not self.rollout_id:
            raise ValueError("rollout_id must be a non-empty string")
        if not self.model_call_id:
            raise ValueError("model_call_id must be a non-empty string")
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError(
                f"generation_token_ids has {len(self.generation_token_ids)} ids but generation_log_probs "
                f"has {len(self.generation_log_probs)} values; they must have equal length"
            )
        # A sum is finite only if every term is (or the terms overflow): check element by element only then.
        if not math.isfinite(sum(self.generation_log_probs)):
            for value in self.generation_log_probs:
                if not math.isfinite(value):
                    raise ValueError(f"generation_log_probs contains a non-finite value {value!r}")
        if self.token_item_index is not None and not 0 <= self.token_item_index < len(self.output_items):
            raise ValueError(
                f"token_item_index {self.token_item_index} does not point inside output_items "
                f"(length {len(self.output_items)})"
            )
        return self

    @classmethod
    def from_json(cls, data: bytes | str) -> TokenEntry:
        """Parse one stored line; newer schemas raise ``NewerSchemaError``, bad lines ``RecordValidationError``."""
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise RecordValidationError(f"record is not valid JSON: {exc}") from exc
        return cls.from_mapping(raw)

    @classmethod
    def from_mapping(cls, raw: Any) -> TokenEntry:
        """Validate decoded JSON into an entry with tokcap's error classes."""
        if not isinstance(raw, dict):
            raise RecordValidationError(f"record must be a JSON object, got {type(raw).__name__}")
        _refuse_newer_schema(raw.get("schema_version"), "record")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise RecordValidationError(
                f"invalid TokenEntry for rollout {raw.get('rollout_id')!r} call {raw.get('model_call_id')!r}: {exc}",
                rollout_id=raw.get("rollout_id") if isinstance(raw.get("rollout_id"), str) else None,
                model_call_id=raw.get("model_call_id") if isinstance(raw.get("model_call_id"), str) else None,
            ) from exc

    def canonical_json(self) -> bytes:
        """The one byte encoding of this entry: JSON with sorted keys, no trailing newline.

        It is pydantic's JSON-mode dump, serialized by orjson.
        The fast path hands the field values to orjson directly, which skips copying the token arrays;
        any value orjson would render differently from pydantic (a datetime, a dataclass, a subclass of a
        builtin) makes orjson refuse, and the entry takes the slow path, so both give the same bytes.
        """
        values = dict(self.__dict__)
        if self.__pydantic_extra__:
            values.update(self.__pydantic_extra__)
        try:
            return orjson.dumps(values, option=_CANONICAL_FAST_OPTIONS)
        except TypeError:
            return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)

    def digest(self) -> str:
        """sha256 hex of the canonical JSON; equal digests mean the same payload."""
        return entry_digest(self.canonical_json())


def entry_digest(canonical: bytes) -> str:
    """sha256 hex of a canonical entry line (without its newline)."""
    return hashlib.sha256(canonical).hexdigest()


@dataclass(frozen=True)
class ExtractedTokenFields:
    """Token arrays found on one item of a model response, and which item carried them."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    item_index: int
    routed_experts: Any = None


def response_items(response_json: Mapping[str, Any]) -> Sequence[Any] | None:
    """Responses-API payloads keep items under ``output``; Chat Completions under ``choices[*].message``."""
    output = response_json.get("output")
    if isinstance(output, list):
        return output
    choices = response_json.get("choices")
    if isinstance(choices, list):
        return [choice.get("message") if isinstance(choice, Mapping) else None for choice in choices]
    return None


def extract_token_fields(response_json: Mapping[str, Any]) -> ExtractedTokenFields | None:
    """Pull the token arrays off a Responses-API or Chat Completions payload.

    Return ``None`` when no item carries token ids.
    Raise ``TokenExtractionError`` when more than one item does, or when an item carries only part of them.
    """
    if not isinstance(response_json, Mapping):
        raise TokenExtractionError(f"response must be a JSON object, got {type(response_json).__name__}")
    items = response_items(response_json)
    if items is None:
        return None
    found: ExtractedTokenFields | None = None
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue
        present = [name for name in TOKEN_FIELDS if item.get(name) is not None]
        if not present:
            continue
        if len(present) != len(TOKEN_FIELDS):
            missing = [name for name in TOKEN_FIELDS if name not in present]
            raise TokenExtractionError(
                f"output item {index} carries {present} but not {missing}; token metadata must be complete"
            )
        if found is not None:
            raise TokenExtractionError(
                f"output items {found.item_index} and {index} both carry token ids; exactly one item may"
            )
        arrays = [item[name] for name in TOKEN_FIELDS]
        if not all(isinstance(array, list) for array in arrays):
            raise TokenExtractionError(f"output item {index} has token fields that are not lists")
        found = ExtractedTokenFields(
            prompt_token_ids=arrays[0],
            generation_token_ids=arrays[1],
            generation_log_probs=arrays[2],
            item_index=index,
            routed_experts=item.get("routed_experts"),
        )
    return found


def strip_token_fields(item: Mapping[str, Any]) -> dict[str, Any]:
    """Copy an output item without its token arrays, keeping the captured content."""
    dropped = set(TOKEN_FIELDS) | set(_OPTIONAL_TOKEN_FIELDS)
    return {key: value for key, value in item.items() if key not in dropped}

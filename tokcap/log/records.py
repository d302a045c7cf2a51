"""The training-token record: one ``TokenEntry`` per model call, field for field Gym 0.7.0's.

A record holds the exact prompt token ids, generated token ids and their log
probabilities of one call, the assistant content without the arrays, and the
lineage metadata (parent link, cumulative length and digest, request-time
resolution) that Gym's builder verifies.
Its canonical JSON (keys sorted, orjson, pydantic's JSON-mode dump) is what the
store writes; it is byte-identical to the line Gym's own store writes.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tokcap.errors import NewerSchemaError, RecordValidationError, TokenExtractionError
from tokcap.log.canonical_json import require_canonical_floats
from tokcap.log.hashing import sha256_hex, sha256_hex_of

__all__ = [
    "DIGEST_VERSION",
    "REQUIRED_TOKEN_FIELDS",
    "TOKEN_ENTRY_MIN_SCHEMA_VERSION",
    "TOKEN_ENTRY_RECORD_SCHEMA_VERSION",
    "TOKEN_FIELDS",
    "ExtractedTokenFields",
    "ParentResolutionStatus",
    "TokenEntry",
    "as_token_entry",
    "compute_digest",
    "cumulative_tokens",
    "digest_of_packed",
    "encode_token_ids",
    "entry_digest",
    "extract_token_fields",
    "find_token_fields",
    "pack_token_ids",
    "response_items",
    "stamp_lineage",
    "strip_token_arrays",
    "strip_token_fields",
    "token_count",
]

TOKEN_ENTRY_RECORD_SCHEMA_VERSION = 1
"""The newest record schema this reader understands; newer records are refused."""

TOKEN_ENTRY_MIN_SCHEMA_VERSION = 1
"""The oldest record schema this reader accepts; older (pre-lineage) records are refused, as Gym does."""

DIGEST_VERSION = 1
"""The version byte that opens every encoded token sequence; a change of encoding must change digests."""

_DIGEST_DOMAIN = b"nemo-gym-tokens"
"""The prefix hashed before the encoded tokens, so these digests cannot collide with other sha256 uses."""

TOKEN_FIELDS: tuple[str, ...] = (
    "prompt_token_ids",
    "generation_token_ids",
    "generation_log_probs",
    "routed_experts",
)
"""Token metadata a model response item may carry (Gym's tuple); ``routed_experts`` is optional."""

REQUIRED_TOKEN_FIELDS: tuple[str, ...] = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""The arrays an item must carry all of, or none of."""

require_canonical_floats()

_CANONICAL_FAST_OPTIONS = (
    orjson.OPT_SORT_KEYS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


class ParentResolutionStatus(StrEnum):
    """The request-time decision about a call's predecessor: a root, a proven parent, or none proven."""

    ROOT = "root"
    RESOLVED = "resolved"
    UNRESOLVED = "unresolved"


def _refuse_newer_schema(version: object, what: str) -> None:
    """Fail loudly on a record from a newer writer: skipping it would silently lose a turn."""
    if isinstance(version, int) and version > TOKEN_ENTRY_RECORD_SCHEMA_VERSION:
        raise NewerSchemaError(
            f"{what} has schema_version {version}, but this reader knows only up to "
            f"{TOKEN_ENTRY_RECORD_SCHEMA_VERSION}; upgrade tokcap on the reading side"
        )


class TokenEntry(BaseModel):
    """One model call's training tokens and lineage, keyed by rollout id and model call id.

    The fields, types, defaults and checks are Gym 0.7.0's, so an entry either side writes is read
    the same way by the other.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=False)

    schema_version: int = TOKEN_ENTRY_RECORD_SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: Any | None = None
    output_items: list[dict[Any, Any]] = Field(default_factory=list)
    token_item_index: int | None = None
    response_id: str | None = None
    created_at: float = 0.0
    parent_call_id: str | None = None
    cum_len: int | None = None
    digest: str | None = None
    parent_resolution: ParentResolutionStatus | None = None
    continuation_fingerprint: str = ""
    continuation_context_len: int = 0
    continuation_context_digest: str = ""
    parent_resolution_reason: str = ""
    fingerprint_version: int | None = None
    prompt_is_delta: bool = False
    prefix_requested: bool = False
    prefix_supplied: bool = False

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
        """A record whose arrays or lineage disagree cannot be trained on; refuse it at the door."""
        if self.schema_version < TOKEN_ENTRY_MIN_SCHEMA_VERSION:
            raise ValueError(
                f"record schema_version {self.schema_version} is below the supported minimum "
                f"{TOKEN_ENTRY_MIN_SCHEMA_VERSION}; regenerate the rollout with a current writer"
            )
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError(
                f"generation_token_ids has {len(self.generation_token_ids)} ids but generation_log_probs "
                f"has {len(self.generation_log_probs)} values; they must have equal length"
            )
        # NaN or infinity would be stored as JSON null, a line no reader (Gym's included) can load again.
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
        _check_lineage(self.parent_call_id, self.parent_resolution)
        if self.prompt_is_delta and (
            self.parent_call_id is None or self.parent_resolution != ParentResolutionStatus.RESOLVED
        ):
            raise ValueError(
                "prompt_is_delta needs a RESOLVED parent_call_id: a delta prompt is rebuilt from its parent"
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

        It is pydantic's JSON-mode dump, serialized by orjson, which is what Gym's store writes.
        The fast path hands the field values to orjson directly, which skips copying the token arrays;
        any value orjson would render differently from pydantic (a datetime, a dataclass, a subclass of a
        builtin) makes orjson refuse, and the entry takes the slow path, so both give the same bytes.
        """
        values = dict(self.__dict__)
        if self.__pydantic_extra__:
            values.update(self.__pydantic_extra__)
        resolution = values.get("parent_resolution")
        if isinstance(resolution, Enum):
            values["parent_resolution"] = resolution.value
        try:
            return orjson.dumps(values, option=_CANONICAL_FAST_OPTIONS)
        except TypeError:
            return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)

    def payload_digest(self) -> str:
        """sha256 hex of the canonical JSON; equal digests mean the same payload.

        Not to be confused with the ``digest`` field, Gym's digest of the cumulative token sequence.
        """
        return entry_digest(self.canonical_json())


def _check_lineage(parent_call_id: str | None, resolution: ParentResolutionStatus | None) -> None:
    """A resolved call names its parent; a root or unresolved call names none."""
    if resolution == ParentResolutionStatus.RESOLVED and not parent_call_id:
        raise ValueError("parent_resolution 'resolved' needs a parent_call_id")
    if (
        resolution in (ParentResolutionStatus.ROOT, ParentResolutionStatus.UNRESOLVED)
        and parent_call_id is not None
    ):
        raise ValueError(f"parent_resolution {resolution.value!r} cannot carry a parent_call_id")


def entry_digest(canonical: bytes) -> str:
    """sha256 hex of a canonical entry line (without its newline)."""
    return sha256_hex(canonical)


def as_token_entry(entry: Any) -> TokenEntry:
    """The one conversion at tokcap's API boundary: a tokcap entry as is, a Gym entry or a mapping validated.

    A Gym ``TokenEntry`` is another pydantic class with the same fields; its JSON-mode dump validated here
    gives the same canonical line Gym's store would write for it.
    """
    if isinstance(entry, TokenEntry):
        return entry
    if isinstance(entry, Mapping):
        return TokenEntry.from_mapping(dict(entry))
    dump = getattr(entry, "model_dump", None)
    if callable(dump):
        # Gym's middleware stamps the resolver's status as given; tokcap's resolvers give tokcap's enum, which
        # Gym's serializer renders as its value after a warning. The value is validated here again.
        return TokenEntry.from_mapping(dump(mode="json", warnings=False))
    raise RecordValidationError(
        f"cannot store a {type(entry).__name__} as a token entry; pass a TokenEntry (tokcap's or Gym's) or a dict"
    )


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Gym's byte encoding of a token sequence: version byte, 8-byte count, then 8 bytes per id, big-endian."""
    return _digest_header(len(token_ids)) + pack_token_ids(token_ids)


def _digest_header(count: int) -> bytes:
    return struct.pack(">BQ", DIGEST_VERSION, count)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """The ids as ``encode_token_ids`` lays them out after its header: 8 bytes each, big-endian.

    Packings of consecutive pieces join into the packing of the whole, so a reader that keeps a sequence's
    packing extends it by the new ids only (``digest_of_packed``).
    """
    try:
        packed = array("Q", token_ids)
    except (OverflowError, TypeError):
        bad = next((token for token in token_ids if not 0 <= token < 2**64), None)
        raise ValueError(f"token ids must be non-negative 64-bit integers, got {bad}") from None
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


def digest_of_packed(packed: bytes) -> str:
    """``compute_digest`` of the sequence whose ``pack_token_ids`` is ``packed``."""
    if not packed:
        return hashlib.sha256(_DIGEST_DOMAIN).hexdigest()
    # Hashed in two parts: joining them would copy the whole packing once more.
    return sha256_hex_of((_DIGEST_DOMAIN + _digest_header(len(packed) // 8), packed))


def compute_digest(token_ids: Sequence[int]) -> str:
    """Gym's digest of an exact token sequence, which the builder checks a child's prompt prefix against.

    The empty sequence hashes the domain alone, as Gym does.
    """
    if not token_ids:
        return hashlib.sha256(_DIGEST_DOMAIN).hexdigest()
    return digest_of_packed(pack_token_ids(token_ids))


def token_count(entry: TokenEntry) -> int:
    """Prompt plus generated tokens the entry carries as stored: what bounds on kept entries count."""
    return len(entry.prompt_token_ids) + len(entry.generation_token_ids)


def cumulative_tokens(entry: TokenEntry) -> list[int]:
    """The full sequence a child of this call starts with; a delta entry must be rebuilt through its parent."""
    if entry.prompt_is_delta:
        raise ValueError(
            f"model call {entry.model_call_id} stores a delta prompt; rebuild it through its parent chain first"
        )
    return [*entry.prompt_token_ids, *entry.generation_token_ids]


def stamp_lineage(
    entry: TokenEntry,
    parent_call_id: str | None,
    *,
    parent_resolution: ParentResolutionStatus | None = None,
    cumulative: list[int] | None = None,
) -> TokenEntry:
    """Fill ``cum_len``, ``digest``, the parent link and the resolution on the entry itself; return it.

    ``cumulative`` is required for a delta entry; for a full entry it must equal the entry's own arrays.
    Like Gym, the fields are set before the link is checked, so a refused link leaves them set.
    """
    if cumulative is None:
        cumulative = cumulative_tokens(entry)
    elif not entry.prompt_is_delta and cumulative != cumulative_tokens(entry):
        raise ValueError("the cumulative tokens given disagree with the entry's own prompt and generation")
    entry.cum_len = len(cumulative)
    entry.digest = compute_digest(cumulative)
    entry.parent_call_id = parent_call_id
    entry.parent_resolution = parent_resolution
    _check_lineage(parent_call_id, parent_resolution)
    return entry


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


def _token_carriers(response_json: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every Responses item and every chat message carrying any token array, in that order (Gym's scan)."""
    carriers: list[Mapping[str, Any]] = []
    candidates: list[Any] = list(response_json.get("output") or [])
    for choice in response_json.get("choices") or []:
        candidates.append((choice or {}).get("message") if isinstance(choice or {}, Mapping) else None)
    for item in candidates:
        if isinstance(item, Mapping) and any(item.get(name) is not None for name in REQUIRED_TOKEN_FIELDS):
            carriers.append(item)
    return carriers


def extract_token_fields(response_json: Mapping[str, Any]) -> dict[str, Any] | None:
    """Gym's shape: the four ``TOKEN_FIELDS`` of the one token-bearing item as a dict, or ``None``.

    Raise ``TokenExtractionError`` (a ``ValueError``) when several items carry token ids or one carries
    only part of them.
    """
    if not isinstance(response_json, Mapping):
        raise TokenExtractionError(f"response must be a JSON object, got {type(response_json).__name__}")
    carriers = _token_carriers(response_json)
    if not carriers:
        return None
    if len(carriers) > 1:
        raise TokenExtractionError(
            f"{len(carriers)} response items carry token metadata; exactly one item may"
        )
    source = carriers[0]
    missing = [name for name in REQUIRED_TOKEN_FIELDS if source.get(name) is None]
    if missing:
        raise TokenExtractionError(f"partial token metadata is missing: {', '.join(missing)}")
    return {name: source.get(name) for name in TOKEN_FIELDS}


def find_token_fields(response_json: Mapping[str, Any]) -> ExtractedTokenFields | None:
    """tokcap's typed helper: the token arrays and the index of the item among ``response_items``.

    Same acceptance as ``extract_token_fields``; arrays that are not lists are refused too.
    """
    fields = extract_token_fields(response_json)
    if fields is None:
        return None
    arrays = [fields[name] for name in REQUIRED_TOKEN_FIELDS]
    if not all(isinstance(array, list) for array in arrays):
        raise TokenExtractionError("the token fields of the response are not lists")
    items = response_items(response_json) or []
    carrier = _token_carriers(response_json)[0]
    index = next((position for position, item in enumerate(items) if item is carrier), None)
    if index is None:
        raise TokenExtractionError(
            "the token-bearing item is not among the response's items (output and choices both present?)"
        )
    return ExtractedTokenFields(
        prompt_token_ids=arrays[0],
        generation_token_ids=arrays[1],
        generation_log_probs=arrays[2],
        item_index=index,
        routed_experts=fields["routed_experts"],
    )


def strip_token_arrays(item: Mapping[str, Any]) -> dict[str, Any]:
    """Copy one output item without its token metadata, keeping the captured content."""
    return {key: value for key, value in item.items() if key not in TOKEN_FIELDS}


def strip_token_fields(items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int | None]:
    """Gym's shape: the items without token metadata, and the index of the one that had generated ids.

    Raise ``TokenExtractionError`` (a ``ValueError``) when more than one item carries them.
    """
    carriers = [
        position for position, item in enumerate(items) if item.get("generation_token_ids") is not None
    ]
    if len(carriers) > 1:
        raise TokenExtractionError("multiple output items carry token metadata")
    return [strip_token_arrays(item) for item in items], carriers[0] if carriers else None

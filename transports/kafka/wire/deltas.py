"""A wire delta: a put sent as its parent's link and the prompt suffix after it, restored exactly by the reader.

Layout (``binary_frame``, magic ``TKD1``): the packed layout (``packed_arrays``) with the prompt suffix in
place of the prompt, fields holding their default left out, and two head fields more: the parent link
(partition, offset, call id, length) and the sha256 of the whole entry the sink was given, which proves the
restored entry. Its messages carry schema version ``WIRE_DELTA_SCHEMA_VERSION``, so a reader that cannot
restore one refuses it as newer instead of misreading it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokcap.errors import EventDecodeError, InvalidInputError, NewerSchemaError
from tokcap.log.events import PutEvent
from tokcap.log.input_rules import check_entry_fields
from transports.kafka.errors import WireDeltaError
from transports.kafka.wire.input_refusals import accepted, refused
from transports.kafka.wire.messages import (
    ENCODING_DELTA,
    HEADER_ENCODING,
    HEADER_SCHEMA,
    HEADER_TYPE,
    HEADER_WRITER,
    OutgoingMessage,
    rollout_of_key,
)
from transports.kafka.wire.packed_arrays import DELTA_PROMPT_FIELD, pack_arrays, unpack_arrays

__all__ = [
    "WIRE_DELTA_SCHEMA_VERSION",
    "ParentLink",
    "WireDelta",
    "decode_wire_delta",
    "encode_delta_message",
    "is_wire_delta",
]

WIRE_DELTA_SCHEMA_VERSION = 2
"""The message schema of a wire delta; readers that know only schema 1 refuse it as newer."""

_DELTA_MAGIC = b"TKD1"
_DELTA_FIELDS = (DELTA_PROMPT_FIELD, "generation_token_ids", "generation_log_probs")


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
            raise refused(exc) from exc

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
        event = accepted(mapping, token_ids_checked=True)
        if not isinstance(event, PutEvent):
            raise EventDecodeError(f"a wire delta must be a put event, got {event.type.value}")
        event.entry.__dict__["prompt_token_ids"] = prefix + self.suffix
        if event.payload_digest != self.entry_digest:
            raise WireDeltaError(
                f"the entry restored from parent {self.link.model_call_id!r} at offset {self.link.offset} "
                "does not match the digest of the entry the sink sent"
            )
        return event


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
    value = pack_arrays(
        _DELTA_MAGIC,
        event,
        prompt_field=DELTA_PROMPT_FIELD,
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
        mapping = unpack_arrays(value, _DELTA_MAGIC, _DELTA_FIELDS)[0]
        parent, digest = mapping.pop("parent", None), mapping.pop("entry_sha256", None)
        if not isinstance(parent, dict):
            raise EventDecodeError("a wire delta head must carry its parent link")
        link = ParentLink(
            partition=_strict_int(parent.get("partition"), "parent partition"),
            offset=_strict_int(parent.get("offset"), "parent offset"),
            model_call_id=_strict_str(parent.get("model_call_id"), "parent call id"),
            length=_strict_int(parent.get("length"), "parent length"),
        )
        suffix = mapping["entry"].pop(DELTA_PROMPT_FIELD)
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

"""tokcap's own copies of Gym 0.7.0's staging wire records, field for field.

They are what a trainer without Gym gets; with Gym importable, sources build Gym's classes instead
(``tokcap.staging.gym_types``), because Gym's verifier checks types. Names, types, defaults and
validation rules follow Gym's so either side can validate the other's JSON.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, model_validator

from tokcap.staging.digest import (
    EMPTY_EXTRAS_DIGEST,
    carry_is_zero,
    compute_extras_digest,
    compute_staging_digest,
    masks_are_binary,
)

__all__ = [
    "CallRecord",
    "CaptureLedgerCommit",
    "CaptureMode",
    "ManifestFailure",
    "RolloutManifest",
    "RolloutReceipt",
    "StageResult",
    "StagedCallBaseSnapshot",
    "StagedCallRecord",
    "StagedCallSnapshot",
    "staging_key",
]

CaptureMode = Literal["token_in", "text"]
_Identifier = Annotated[StrictStr, Field(min_length=1)]
_NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
_DigestHex = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """The key a staged call is stored under: Gym's default, ``<rollout_id>/<model_call_id>``.

    A rollout id never holds ``/``, so the key splits back at its first slash.
    """
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    return f"{rollout_id}/{model_call_id}"


class _Wire(BaseModel):
    """The versions are ``tokcap.staging.digest``'s ``STAGING_*`` constants, spelled as literals for the type."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: Literal[2] = 2


class _DigestWire(_Wire):
    digest_version: Literal[2] = 2
    extras_digest_version: Literal[1] = 1


def _check_parent_mode(parent_call_id: str | None, prev_len: int, mode: str, what: str) -> None:
    if parent_call_id is None and prev_len != 0:
        raise ValueError(f"a parentless {what} must have prev_len == 0")
    if parent_call_id is not None and prev_len == 0:
        raise ValueError(f"a child {what} must have prev_len > 0")
    if parent_call_id is None and mode != "text":
        raise ValueError(f"a parentless {what} must use text mode")
    if parent_call_id is not None and mode != "token_in":
        raise ValueError(f"a child {what} must use token_in mode")


class StagedCallBaseSnapshot(_DigestWire):
    """One staged call's token columns and metadata, without its extras; the digest is checked on build."""

    rollout_id: _Identifier
    model_call_id: _Identifier
    parent_call_id: _Identifier | None = None
    mode: CaptureMode
    prev_len: _NonNegativeInt
    delta_len: _NonNegativeInt
    cum_len: _NonNegativeInt
    weight_version: _NonNegativeInt
    digest: _DigestHex
    token_ids_delta: list[StrictInt]
    token_mask_delta: list[StrictFloat]
    generation_log_probs_delta: list[StrictFloat]
    extras_digest: _DigestHex = EMPTY_EXTRAS_DIGEST
    chain_hash: _DigestHex
    cumulative_hash: _DigestHex

    @property
    def staging_key(self) -> str:
        """The key this call is stored under."""
        return staging_key(self.rollout_id, self.model_call_id)

    @model_validator(mode="after")
    def _integrity(self) -> Self:
        _check_parent_mode(self.parent_call_id, self.prev_len, self.mode, "staged call")
        if self.delta_len == 0:
            raise ValueError("a staged call delta must contain at least one token")
        if self.token_ids_delta and min(self.token_ids_delta) < 0:
            raise ValueError("token_ids_delta must be non-negative")
        if not masks_are_binary(self.token_mask_delta):
            raise ValueError("token_mask_delta must contain only 0.0 or 1.0")
        if not carry_is_zero(self.token_mask_delta, self.generation_log_probs_delta):
            raise ValueError("prompt-carry log probabilities must be 0.0")
        if self.digest != compute_staging_digest(**_digest_fields(self)):
            raise ValueError("digest does not match staged call contents")
        return self


def _digest_fields(row: StagedCallBaseSnapshot) -> dict[str, Any]:
    return {
        "schema_version": row.schema_version,
        "digest_version": row.digest_version,
        "extras_digest_version": row.extras_digest_version,
        "rollout_id": row.rollout_id,
        "model_call_id": row.model_call_id,
        "parent_call_id": row.parent_call_id,
        "mode": row.mode,
        "prev_len": row.prev_len,
        "delta_len": row.delta_len,
        "cum_len": row.cum_len,
        "weight_version": row.weight_version,
        "token_ids_delta": row.token_ids_delta,
        "token_mask_delta": row.token_mask_delta,
        "generation_log_probs_delta": row.generation_log_probs_delta,
        "extras_digest": row.extras_digest,
        "chain_hash": row.chain_hash,
        "cumulative_hash": row.cumulative_hash,
    }


class StagedCallRecord(StagedCallBaseSnapshot):
    """A staged call with its extras, as a worker hands it to ``stage``."""

    extras: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _extras_integrity(self) -> Self:
        if self.extras_digest != compute_extras_digest(self.extras):
            raise ValueError("extras_digest does not match extras")
        return self


class StagedCallSnapshot(StagedCallRecord):
    """The exact staged record a source returns from ``fetch_full``."""


class StageResult(_Wire):
    """What ``stage`` answers: ok with the key, or an error."""

    ok: bool
    staging_key: _Identifier | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.ok and self.staging_key is None:
            raise ValueError("a successful stage result requires staging_key")
        if not self.ok and not self.error:
            raise ValueError("a failed stage result requires an error")
        return self


class CallRecord(_DigestWire):
    """One token-free manifest row of a committed call."""

    model_call_id: _Identifier
    parent_call_id: _Identifier | None = None
    prev_len: _NonNegativeInt
    delta_len: _NonNegativeInt
    cum_len: _NonNegativeInt
    weight_version: _NonNegativeInt
    digest: _DigestHex
    extras_digest: _DigestHex
    staging_key: _Identifier
    mode: CaptureMode = "token_in"
    chain_hash: _DigestHex
    cumulative_hash: _DigestHex
    response_id: _Identifier
    admitted_at: StrictFloat | None = None
    output_fingerprint: _DigestHex | None = None
    continuation_fingerprint: _DigestHex | None = None
    fingerprint_version: _NonNegativeInt = 0

    @model_validator(mode="after")
    def _lengths(self) -> Self:
        if self.delta_len == 0 or self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("manifest lengths must describe a non-empty contiguous delta")
        _check_parent_mode(self.parent_call_id, self.prev_len, self.mode, "manifest row")
        return self


class CaptureLedgerCommit(_Wire):
    """One staged call as Gym's model server hands it to ``CaptureLedger.record``."""

    rollout_id: _Identifier
    record: CallRecord
    staging_chain: tuple[_Identifier, ...] = ()
    request_items: list[dict[Any, Any]]
    response_items: list[dict[Any, Any]]


class ManifestFailure(_Wire):
    """A call whose capture did not complete; it poisons the rollout."""

    model_call_id: _Identifier
    reason: _Identifier


class RolloutManifest(_Wire):
    """A rollout's token-free ledger: committed rows and failures."""

    rollout_id: _Identifier
    records: list[CallRecord] = Field(default_factory=list)
    failures: list[ManifestFailure] = Field(default_factory=list)


_TerminalMethod = Literal["declared", "response_id", "content", "heuristic"]


class RolloutReceipt(_DigestWire):
    """The manifest a trainer assembles at rollout end, naming the terminal call (or why it is poisoned)."""

    rollout_id: _Identifier
    reward: float | None = None
    terminal_model_call_id: _Identifier | None = None
    manifest: list[CallRecord] = Field(default_factory=list)
    capture_poisoned: bool = False
    failure_reason: str | None = None
    terminal_selection: _TerminalMethod | None = None
    terminal_attribution_reason: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        ids = [record.model_call_id for record in self.manifest]
        if len(ids) != len(set(ids)):
            raise ValueError("receipt manifest contains duplicate model_call_id values")
        if self.terminal_model_call_id is not None and self.terminal_model_call_id not in set(ids):
            raise ValueError("terminal_model_call_id is absent from the receipt manifest")
        if not self.capture_poisoned:
            if self.failure_reason is not None:
                raise ValueError("an unpoisoned receipt cannot carry a failure_reason")
            if self.terminal_model_call_id is None or self.terminal_selection is None:
                raise ValueError(
                    "an unpoisoned receipt must name terminal_model_call_id and terminal_selection"
                )
        if self.terminal_selection is None:
            if self.terminal_model_call_id is not None:
                raise ValueError("terminal_model_call_id requires a terminal_selection method")
            if self.failure_reason is None:
                raise ValueError("a receipt with no attribution stage must be poisoned with a failure_reason")
        return self

"""``verify_and_linearize``: a trainer's check of a rollout's staged rows against its receipt, without Gym.

It gives the same row as Gym 0.7.0's function on the same inputs and raises a ``ValueError``
(``ReceiptVerificationError``, with Gym's code) wherever Gym's raises one: every manifest row must have
exactly one snapshot, in manifest order, agreeing with it field for field; every snapshot's digest is
recomputed; the parent links must form a tree; and the chain from root to the receipt's terminal must
extend each chain hash and end at the terminal's cumulative hash. Extras are never read: the row carries
each selected call's extras digest for the consumer to check at its point of use.
It accepts Gym's receipt and snapshot classes as well as tokcap's, reading only their fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokcap.errors import RebuildError, ReceiptVerificationError
from tokcap.staging.digest import (
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    compute_chain_hash,
    compute_staging_digest,
    hash_token_ids,
)

__all__ = ["ExtrasCommitment", "LinearizedRow", "WeightVersionSpan", "verify_and_linearize"]

_COMPARED = (
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)
_VERSIONS = ("schema_version", "digest_version", "extras_digest_version")


@dataclass(frozen=True)
class WeightVersionSpan:
    """The policy version that produced one call's span of the row."""

    model_call_id: str
    start: int
    end: int
    weight_version: int


@dataclass(frozen=True)
class ExtrasCommitment:
    """What one selected call's extras must hash to; fetch and check them at the point of use."""

    model_call_id: str
    extras_digest_version: int
    extras_digest: str


@dataclass(frozen=True)
class LinearizedRow:
    """One verified terminal chain: the training row (Gym's fields)."""

    rollout_id: str
    token_ids: list[int]
    token_mask: list[float]
    logprobs: list[float]
    model_call_ids: list[str]
    prompt_len: int
    weight_versions: list[int]
    weight_version_spans: list[WeightVersionSpan]
    link_spans: list[tuple[str, int, int]] = field(default_factory=list)
    extras_commitments: list[ExtrasCommitment] = field(default_factory=list)

    @property
    def call_ids(self) -> list[str]:
        """Gym's other name for ``model_call_ids``."""
        return self.model_call_ids


def _is_model(value: Any, class_name: str) -> bool:
    return any(cls.__name__ == class_name for cls in type(value).__mro__) and hasattr(value, "model_dump")


def _check_rows(receipt: Any, snapshots: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Bind each manifest row to its snapshot and check both; return them by call id."""
    records: dict[str, Any] = {}
    keys: set[str] = set()
    for record in receipt.manifest:
        if record.model_call_id in records:
            raise ReceiptVerificationError("duplicate_manifest_row", "model_call_id values are not unique")
        if record.staging_key in keys:
            raise ReceiptVerificationError("duplicate_staging_key", "staging keys are not unique")
        records[record.model_call_id] = record
        keys.add(record.staging_key)
    if len(snapshots) != len(receipt.manifest):
        raise ReceiptVerificationError(
            "row_count_mismatch", f"{len(snapshots)} snapshots for {len(receipt.manifest)} manifest rows"
        )
    bound: dict[str, Any] = {}
    for record, snapshot in zip(receipt.manifest, snapshots, strict=True):
        if not _is_model(snapshot, "StagedCallBaseSnapshot"):
            raise TypeError("snapshots must contain StagedCallBaseSnapshot values")
        call_id = snapshot.model_call_id
        if call_id in bound:
            raise ReceiptVerificationError("duplicate_snapshot", "model_call_id values are not unique")
        if call_id not in records:
            raise ReceiptVerificationError(
                "snapshot_identity_mismatch", f"snapshot {call_id} is not in the manifest"
            )
        if call_id != record.model_call_id:
            raise ReceiptVerificationError(
                "snapshot_order_mismatch",
                f"key {record.staging_key} expected {record.model_call_id}, received {call_id}",
            )
        bound[call_id] = snapshot
        _check_fields(receipt, record, snapshot)
        _check_digest(snapshot)
    return records, bound


def _check_fields(receipt: Any, record: Any, snapshot: Any) -> None:
    call_id = record.model_call_id
    if snapshot.rollout_id != receipt.rollout_id:
        raise ReceiptVerificationError(
            "wrong_rollout", f"snapshot {call_id} belongs to {snapshot.rollout_id}"
        )
    for name in _COMPARED:
        actual, expected = getattr(snapshot, name), getattr(record, name)
        if actual != expected:
            raise ReceiptVerificationError(
                f"wrong_{name}", f"call {call_id}: snapshot {actual!r}, manifest {expected!r}"
            )
    for name in _VERSIONS:
        actual, expected, declared = getattr(snapshot, name), getattr(record, name), getattr(receipt, name)
        if actual != expected or actual != declared:
            raise ReceiptVerificationError(
                f"wrong_{name}", f"call {call_id}: snapshot={actual}, manifest={expected}, receipt={declared}"
            )


def _check_digest(snapshot: Any) -> None:
    call_id = snapshot.model_call_id
    try:
        digest = compute_staging_digest(
            **{name: getattr(snapshot, name) for name in _VERSIONS},
            rollout_id=snapshot.rollout_id,
            model_call_id=call_id,
            parent_call_id=snapshot.parent_call_id,
            mode=snapshot.mode,
            prev_len=snapshot.prev_len,
            delta_len=snapshot.delta_len,
            cum_len=snapshot.cum_len,
            weight_version=snapshot.weight_version,
            token_ids_delta=snapshot.token_ids_delta,
            token_mask_delta=snapshot.token_mask_delta,
            generation_log_probs_delta=snapshot.generation_log_probs_delta,
            extras_digest=snapshot.extras_digest,
            chain_hash=snapshot.chain_hash,
            cumulative_hash=snapshot.cumulative_hash,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise ReceiptVerificationError("invalid_snapshot", f"call {call_id}: {exc}") from exc
    if digest != snapshot.digest:
        raise ReceiptVerificationError("corrupt_digest", f"call {call_id}: staged digest mismatch")


def _check_graph(records: dict[str, Any]) -> None:
    for call_id, record in records.items():
        if record.parent_call_id is not None:
            parent = records.get(record.parent_call_id)
            if parent is None:
                raise RebuildError(
                    "missing_parent", f"call {call_id} names absent parent {record.parent_call_id}"
                )
            if parent.cum_len != record.prev_len:
                raise RebuildError(
                    "parent_length_mismatch",
                    f"call {call_id} starts at {record.prev_len}, parent ends at {parent.cum_len}",
                )
        seen: set[str] = set()
        cursor = record
        while cursor is not None:
            if cursor.model_call_id in seen:
                raise RebuildError("lineage_cycle", f"cycle reaches call {cursor.model_call_id}")
            seen.add(cursor.model_call_id)
            cursor = records.get(cursor.parent_call_id) if cursor.parent_call_id is not None else None


def _chain(receipt: Any, records: dict[str, Any]) -> list[Any]:
    terminal = receipt.terminal_model_call_id
    if terminal is None:
        raise RebuildError("missing_terminal", "successful receipt has no terminal call")
    cursor = records.get(terminal)
    if cursor is None:
        raise RebuildError("missing_terminal", f"terminal call {terminal} is absent")
    chain = []
    while cursor is not None:
        chain.append(cursor)
        cursor = records.get(cursor.parent_call_id) if cursor.parent_call_id is not None else None
    return chain[::-1]


def _carry_boundary(snapshot: Any) -> int:
    """How many leading tokens are prompt carry (mask 0.0); the rest must all be generated (mask 1.0)."""
    masks = snapshot.token_mask_delta
    boundary = next((index for index, mask in enumerate(masks) if mask != 0.0), len(masks))
    if any(mask != 1.0 for mask in masks[boundary:]):
        raise RebuildError(
            "invalid_mask_order", f"call {snapshot.model_call_id} mask is not carry-then-generation"
        )
    if boundary == len(masks):
        raise RebuildError(
            "empty_generation", f"call {snapshot.model_call_id} contains no policy-generated token"
        )
    return boundary


def verify_and_linearize(receipt: Any, snapshots: Sequence[Any]) -> LinearizedRow:
    """Verify untrusted staged rows against a receipt and return the terminal chain's training row."""
    if not _is_model(receipt, "RolloutReceipt"):
        raise TypeError("receipt must be a RolloutReceipt")
    expected = (STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION)
    codes = ("unsupported_schema", "unsupported_digest", "unsupported_extras_digest")
    for name, code, wanted in zip(_VERSIONS, codes, expected, strict=True):
        if getattr(receipt, name) != wanted:
            raise ReceiptVerificationError(code, f"receipt {name} {getattr(receipt, name)}")
    if receipt.failure_reason is not None:
        raise ReceiptVerificationError("rollout_failed", receipt.failure_reason)
    if receipt.capture_poisoned:
        raise ReceiptVerificationError("capture_poisoned", "receipt marks token capture as poisoned")
    if not receipt.manifest:
        raise ReceiptVerificationError("empty_manifest", "successful receipt has no committed calls")
    records, bound = _check_rows(receipt, snapshots)
    _check_graph(records)
    chain = _chain(receipt, records)
    tokens: list[int] = []
    masks: list[float] = []
    log_probs: list[float] = []
    spans: list[WeightVersionSpan] = []
    links: list[tuple[str, int, int]] = []
    prompt_len = 0
    running: str | None = None
    for index, record in enumerate(chain):
        snapshot = bound[record.model_call_id]
        running = compute_chain_hash(running, snapshot.token_ids_delta)
        if record.chain_hash != running:
            raise RebuildError(
                "chain_hash_mismatch",
                f"call {record.model_call_id} does not extend its parent's staged chain",
            )
        boundary = _carry_boundary(snapshot)
        start = len(tokens)
        tokens.extend(snapshot.token_ids_delta)
        masks.extend(snapshot.token_mask_delta)
        log_probs.extend(snapshot.generation_log_probs_delta)
        if index == 0:
            prompt_len = boundary
        spans.append(WeightVersionSpan(record.model_call_id, start, len(tokens), record.weight_version))
        links.append((record.model_call_id, boundary, record.delta_len - boundary))
    if not any(masks):
        raise RebuildError("empty_training_row", "terminal chain has no generated tokens")
    if chain[-1].cumulative_hash != hash_token_ids(tokens):
        raise RebuildError(
            "cumulative_hash_mismatch",
            f"terminal call {chain[-1].model_call_id} cumulative hash does not cover the linearized tokens",
        )
    return LinearizedRow(
        rollout_id=receipt.rollout_id,
        token_ids=tokens,
        token_mask=masks,
        logprobs=log_probs,
        model_call_ids=[record.model_call_id for record in chain],
        prompt_len=prompt_len,
        weight_versions=[record.weight_version for record in chain],
        weight_version_spans=spans,
        link_spans=links,
        extras_commitments=[
            ExtrasCommitment(record.model_call_id, record.extras_digest_version, record.extras_digest)
            for record in chain
        ],
    )

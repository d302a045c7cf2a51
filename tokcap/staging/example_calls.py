"""Staged calls and the ledger commits Gym's model server writes for them, with every digest computed.

What a conformance check, a demo or a benchmark stages: Gym's own classes when ``nemo_gym`` imports,
tokcap's equivalents otherwise, so a verifier that checks types accepts them.
"""

from __future__ import annotations

from typing import Any

from tokcap.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint
from tokcap.staging.digest import (
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from tokcap.staging.gym_types import build
from tokcap.staging.records import staging_key

__all__ = ["ExampleCall", "commit_of", "staged_record", "staged_record_fields"]


class ExampleCall:
    """One staged call of a conformance rollout, with the conversation around it."""

    def __init__(self, record: Any, tokens: list[int], request: list[dict[str, Any]], answer: str) -> None:
        self.record = record
        self.tokens = tokens
        self.request = request
        self.response = [{"role": "assistant", "content": answer}]
        self.key = staging_key(record.rollout_id, record.model_call_id)


def staged_record_fields(
    rollout_id: str,
    call_id: str,
    ids: list[int],
    mask: list[float],
    log_probs: list[float],
    *,
    parent: Any = None,
    prefix: list[int] | None = None,
    weight_version: int = 4,
    extras: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every field of a staged record extending ``parent`` (whose tokens are ``prefix``), digests computed."""
    prefix = prefix or []
    fields: dict[str, Any] = {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "parent_call_id": parent.model_call_id if parent is not None else None,
        "mode": "token_in" if parent is not None else "text",
        "prev_len": len(prefix),
        "delta_len": len(ids),
        "cum_len": len(prefix) + len(ids),
        "weight_version": weight_version,
        "token_ids_delta": ids,
        "token_mask_delta": mask,
        "generation_log_probs_delta": log_probs,
        "extras_digest": compute_extras_digest(extras),
        "chain_hash": compute_chain_hash(parent.chain_hash if parent is not None else None, ids),
        "cumulative_hash": hash_token_ids(prefix + ids),
    }
    return {**fields, "digest": compute_staging_digest(**fields), "extras": extras}


def staged_record(
    rollout_id: str,
    call_id: str,
    prompt: list[int],
    generated: list[int],
    parent: ExampleCall | None,
    extras: dict[str, Any] | None = None,
) -> tuple[Any, list[int]]:
    """A staged record (a text root, or a token-in continuation of ``parent``) and its whole token sequence."""
    ids = prompt + generated
    prefix = parent.tokens if parent is not None else []
    mask = [0.0] * len(prompt) + [1.0] * len(generated)
    log_probs = [0.0] * len(prompt) + [-(index + 1) / 3.0 - 1e-13 for index in range(len(generated))]
    fields = staged_record_fields(
        rollout_id,
        call_id,
        ids,
        mask,
        log_probs,
        parent=parent.record if parent is not None else None,
        prefix=prefix,
        extras=extras,
    )
    return build("StagedCallRecord", fields), prefix + ids


def commit_of(call: ExampleCall, chain: list[str], *, response_id: str | None = None) -> Any:
    """The ``CaptureLedgerCommit`` of ``call``, whose staging chain is ``chain`` then the call's own key."""
    record = call.record
    row = {
        "model_call_id": record.model_call_id,
        "parent_call_id": record.parent_call_id,
        "prev_len": record.prev_len,
        "delta_len": record.delta_len,
        "cum_len": record.cum_len,
        "weight_version": record.weight_version,
        "digest": record.digest,
        "extras_digest": record.extras_digest,
        "staging_key": call.key,
        "mode": record.mode,
        "chain_hash": record.chain_hash,
        "cumulative_hash": record.cumulative_hash,
        "response_id": response_id or f"resp-{record.model_call_id}",
        "admitted_at": 1_700_000_000.0 + record.prev_len,
        "output_fingerprint": assistant_fingerprint(call.response) or None,
        "continuation_fingerprint": assistant_fingerprint(call.request + call.response) or None,
        "fingerprint_version": FINGERPRINT_VERSION,
    }
    return build(
        "CaptureLedgerCommit",
        {
            "rollout_id": record.rollout_id,
            "record": row,
            "staging_chain": [*chain, call.key],
            "request_items": call.request,
            "response_items": call.response,
        },
    )

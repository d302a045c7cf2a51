"""Staged calls, ledger commits and receipts for the staging tests, built with tokcap's own digests.

A chain is a text root followed by token-in continuations; each call's delta is the new prompt tokens
(mask 0.0, log prob 0.0) and its generated tokens (mask 1.0, a log prob no float32 holds exactly), so a
store that narrows log probs is caught by the first comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokcap.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint
from tokcap.staging.example_calls import staged_record_fields
from tokcap.staging.records import CallRecord, CaptureLedgerCommit, StagedCallRecord, staging_key


def exact_log_prob(seed: int) -> float:
    """A negative log prob with more precision than float32 keeps."""
    return -((seed % 89) + 1) / 7.0 - 1e-12 * (seed % 13 + 1)


def staged_call(
    rollout_id: str,
    call_id: str,
    prompt_delta: Sequence[int],
    generated: Sequence[int],
    *,
    parent: StagedCallRecord | None = None,
    weight_version: int = 1,
    extras: dict[str, Any] | None = None,
) -> StagedCallRecord:
    """One staged call extending ``parent`` (a text root when ``None``)."""
    ids = list(prompt_delta) + list(generated)
    mask = [0.0] * len(prompt_delta) + [1.0] * len(generated)
    log_probs = [0.0] * len(prompt_delta) + [
        exact_log_prob(token + index) for index, token in enumerate(generated)
    ]
    prefix = _cumulative[(parent.rollout_id, parent.model_call_id)] if parent is not None else []
    _cumulative[(rollout_id, call_id)] = prefix + ids
    fields = staged_record_fields(
        rollout_id,
        call_id,
        ids,
        mask,
        log_probs,
        parent=parent,
        prefix=prefix,
        weight_version=weight_version,
        extras=extras,
    )
    return StagedCallRecord(**fields)


_cumulative: dict[tuple[str, str], list[int]] = {}


def cumulative_tokens(call: StagedCallRecord) -> list[int]:
    """The whole token sequence ending with ``call`` (built by ``staged_call`` in this process)."""
    return list(_cumulative[(call.rollout_id, call.model_call_id)])


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@dataclass
class Turn:
    """A staged call with the conversation it was made in and the answer it produced."""

    call: StagedCallRecord
    request_items: list[dict[str, Any]]
    response_items: list[dict[str, Any]]
    staging_chain: list[str] = field(default_factory=list)


def commit_for(turn: Turn, *, response_id: str | None = None) -> CaptureLedgerCommit:
    """The ledger commit Gym's model server writes for a staged turn."""
    call = turn.call
    key = staging_key(call.rollout_id, call.model_call_id)
    record = CallRecord(
        model_call_id=call.model_call_id,
        parent_call_id=call.parent_call_id,
        prev_len=call.prev_len,
        delta_len=call.delta_len,
        cum_len=call.cum_len,
        weight_version=call.weight_version,
        digest=call.digest,
        extras_digest=call.extras_digest,
        staging_key=key,
        mode=call.mode,
        chain_hash=call.chain_hash,
        cumulative_hash=call.cumulative_hash,
        response_id=response_id or f"resp-{call.model_call_id}",
        admitted_at=1_700_000_000.0 + call.prev_len,
        output_fingerprint=assistant_fingerprint(turn.response_items) or None,
        continuation_fingerprint=assistant_fingerprint(turn.request_items + turn.response_items) or None,
        fingerprint_version=FINGERPRINT_VERSION,
    )
    return CaptureLedgerCommit(
        rollout_id=call.rollout_id,
        record=record,
        staging_chain=(*turn.staging_chain, key),
        request_items=turn.request_items,
        response_items=turn.response_items,
    )


def conversation(rollout_id: str, turns: int, *, base: int = 100, extras: bool = False) -> list[Turn]:
    """A multi-turn rollout: a text root, then token-in continuations each echoing the history."""
    out: list[Turn] = []
    history: list[dict[str, Any]] = []
    parent: StagedCallRecord | None = None
    for number in range(turns):
        history = [*history, user(f"{rollout_id} question {number}")]
        prompt = [base + number * 10 + offset for offset in range(3 if parent is None else 2)]
        generated = [base + number * 10 + 5 + offset for offset in range(2)]
        call_extras = {"routed_experts": [[number, 1], [2, 3.5]], "n": number} if extras else None
        call = staged_call(rollout_id, f"call-{number}", prompt, generated, parent=parent, extras=call_extras)
        chain = (
            [] if parent is None else [*out[-1].staging_chain, staging_key(rollout_id, parent.model_call_id)]
        )
        answer = [assistant(f"{rollout_id} answer {number}")]
        out.append(Turn(call, list(history), answer, chain))
        history = [*history, *answer]
        parent = call
    return out

"""Deterministic builders for records and model responses shared by the tests.

Every value is derived from the arguments, so two calls with the same arguments
build byte-identical entries (equal canonical JSON, equal digests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokcap.log.records import TokenEntry

FIXED_CREATED_AT = 1_700_000_000.0
"""The created_at of every factory entry, so equal arguments give equal payloads."""

DEFAULT_MODEL = "test-model"

_UNSET: Any = object()


def log_prob_for(token_id: int) -> float:
    """A log probability derived from a token id; a negative dyadic fraction, exact in binary."""
    return -((token_id % 97) + 1) / 64.0


def log_probs_for(token_ids: Sequence[int]) -> list[float]:
    """One derived log probability per token id."""
    return [log_prob_for(token_id) for token_id in token_ids]


def assistant_message_item(text: str = "ok", *, item_id: str = "msg_0") -> dict[str, Any]:
    """A Responses-API assistant message item without token arrays."""
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def make_entry(
    rollout_id: str = "rollout-1",
    call_id: str = "call-1",
    prompt: Sequence[int] = (1, 2, 3),
    generation: Sequence[int] = (4, 5),
    *,
    log_probs: Sequence[float] | None = None,
    model: str = DEFAULT_MODEL,
    output_items: Sequence[Mapping[str, Any]] | None = None,
    token_item_index: int | None = _UNSET,
    routed_experts: Any = None,
    created_at: float = FIXED_CREATED_AT,
    **extra: Any,
) -> TokenEntry:
    """Build a valid ``TokenEntry``; log probs default to ones derived from the generated ids.

    ``token_item_index`` defaults to 0 when ``output_items`` is non-empty and to ``None`` otherwise.
    Extra keyword arguments become extra fields on the record.
    """
    items = [dict(item) for item in output_items] if output_items is not None else []
    if token_item_index is _UNSET:
        token_item_index = 0 if items else None
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        model=model,
        prompt_token_ids=list(prompt),
        generation_token_ids=list(generation),
        generation_log_probs=list(log_probs) if log_probs is not None else log_probs_for(generation),
        routed_experts=routed_experts,
        output_items=items,
        token_item_index=token_item_index,
        created_at=created_at,
        **extra,
    )


def token_fields(prompt: Sequence[int], generation: Sequence[int]) -> dict[str, Any]:
    """The three token arrays as a model server attaches them to one response item."""
    return {
        "prompt_token_ids": list(prompt),
        "generation_token_ids": list(generation),
        "generation_log_probs": log_probs_for(generation),
    }


def responses_payload(*items: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses-API response whose ``output`` holds the given items."""
    return {"id": "resp_0", "object": "response", "model": DEFAULT_MODEL, "output": [dict(i) for i in items]}


def chat_completions_payload(*messages: Mapping[str, Any]) -> dict[str, Any]:
    """A Chat Completions response with one choice per given message."""
    return {
        "id": "chatcmpl_0",
        "object": "chat.completion",
        "model": DEFAULT_MODEL,
        "choices": [
            {"index": index, "message": dict(message), "finish_reason": "stop"}
            for index, message in enumerate(messages)
        ],
    }


def chat_response(text: str, prompt: list[int], generation: list[int]) -> dict[str, Any]:
    """A Chat Completions response whose assistant message carries its token arrays (log probs -0.5)."""
    message = {
        "role": "assistant",
        "content": text,
        "prompt_token_ids": prompt,
        "generation_token_ids": generation,
        "generation_log_probs": [-0.5] * len(generation),
    }
    return {"id": f"resp-{text}", "choices": [{"message": message}]}

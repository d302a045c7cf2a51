"""A built chain as a Responses-style response whose output items carry contiguous token arrays.

Shape of ``project_main_chain_response``::

    {
      "id": "tokcap-<rollout_id>",
      "object": "response",
      "model": "<model>",
      "output": [item, ...],
      "usage": {"input_tokens": I, "output_tokens": O, "total_tokens": I + O},
      "metadata": {"tokcap_rollout_id": ..., "tokcap_chain_id": ..., "tokcap_sequence_sha256": ...},
    }

Each call of the chain contributes its captured output items in order (text, reasoning, tool calls),
without token arrays, except the item at its ``token_item_index``, which carries:

- ``prompt_token_ids``: every token before this call's generation (Gym 0.7.0's cumulative format): the
  root prompt for the first call; for later calls the previous item's prompt and generation, then the
  interstitial tokens;
- ``generation_token_ids`` and ``generation_log_probs``: the call's generated tokens and their log probs;
- ``routed_experts``, when the call captured it.

A call captured without content items contributes one synthetic assistant message carrying the arrays.
Each token-bearing item's prompt extends the previous item's prompt and generation, so the last item's
``prompt_token_ids`` then ``generation_token_ids`` are the chain's final token sequence; generated tokens
take loss mask 1, the rest 0. Gym's own ``assert_prefix_contiguity`` accepts this output.
``usage`` counts that sequence: ``input_tokens`` are the masked ones, ``output_tokens`` the generated ones.
``tokcap_sequence_sha256`` is the sha256 of the sequence as a JSON array, so the invariant can be re-checked.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from tokcap.chains import BuildOutput, Chain
from tokcap.errors import PrefixContiguityError, TrajectoryBuildError
from tokcap.log.hashing import sha256_hex
from tokcap.log.records import REQUIRED_TOKEN_FIELDS, strip_token_arrays

__all__ = [
    "assert_prefix_contiguity",
    "project_chain_to_output_items",
    "project_main_chain_response",
    "token_sequence_digest",
]


def token_sequence_digest(token_ids: Sequence[int]) -> str:
    """sha256 hex of a token sequence written as a compact JSON array."""
    return sha256_hex(orjson.dumps(list(token_ids)))


def _synthetic_message() -> dict[str, Any]:
    """Stands in for a call captured without content items, so its tokens still have an item to ride on."""
    return {"type": "message", "role": "assistant", "status": "completed", "content": []}


def project_chain_to_output_items(chain: Chain) -> list[dict[str, Any]]:
    """The chain's output items with contiguous token arrays, as described in the module docstring."""
    items: list[dict[str, Any]] = []
    seen: list[int] = []
    for index, link in enumerate(chain.links):
        entry = link.entry
        seen = list(chain.root_prompt_token_ids) if index == 0 else [*seen, *link.interstitial_token_ids]
        arrays: dict[str, Any] = {
            "prompt_token_ids": list(seen),
            "generation_token_ids": list(entry.generation_token_ids),
            "generation_log_probs": list(entry.generation_log_probs),
        }
        if entry.routed_experts is not None:
            arrays["routed_experts"] = copy.deepcopy(entry.routed_experts)
        call_items = [strip_token_arrays(copy.deepcopy(item)) for item in entry.output_items]
        if entry.token_item_index is None:
            call_items.append(_synthetic_message())
            token_index = len(call_items) - 1
        else:
            token_index = entry.token_item_index
        call_items[token_index] = {**call_items[token_index], **arrays}
        items.extend(call_items)
        seen = [*seen, *entry.generation_token_ids]
    return items


def project_main_chain_response(rollout_id: str, out: BuildOutput, model: str = "") -> dict[str, Any]:
    """The rollout's main chain as one Responses-style dict; raise ``TrajectoryBuildError`` without one.

    ``model`` defaults to the model that served the chain's last call.
    """
    chain = out.main_chain
    if chain is None:
        raise TrajectoryBuildError(
            f"rollout {rollout_id!r} has no main chain to project (builder {out.notes.builder!r} built "
            f"{len(out.chains)} chains); use prefix_merging and check that the calls generated tokens",
            rollout_id=rollout_id,
        )
    tokens = chain.training_tokens()
    generated = chain.generated_token_count
    return {
        "id": f"tokcap-{rollout_id}",
        "object": "response",
        "model": model or chain.links[-1].entry.model,
        "output": project_chain_to_output_items(chain),
        "usage": {
            "input_tokens": len(tokens.token_ids) - generated,
            "output_tokens": generated,
            "total_tokens": len(tokens.token_ids),
        },
        "metadata": {
            "tokcap_rollout_id": rollout_id,
            "tokcap_chain_id": chain.chain_id,
            "tokcap_sequence_sha256": token_sequence_digest(tokens.token_ids),
        },
    }


def _int_list(value: Any, name: str, index: int) -> list[int]:
    if not isinstance(value, list) or not all(type(token) is int for token in value):
        raise PrefixContiguityError(f"output item {index}: {name} must be a list of integers")
    return value


def assert_prefix_contiguity(response: Mapping[str, Any]) -> list[int]:
    """Check that the response's token arrays form one contiguous sequence; return that sequence.

    Gym's rule: each token-bearing item's ``prompt_token_ids`` starts with every token seen so far
    (the previous item's prompt and generation), so the sequence is the last item's prompt and generation.
    Beyond Gym, every token-bearing item must carry all three arrays, as many log probs as generated
    tokens, and at least one generated token; at least one item must bear tokens.
    When the response carries ``usage.output_tokens``, ``usage.total_tokens`` or
    ``metadata.tokcap_sequence_sha256``, the generated count and the sequence must match them.
    Raise ``PrefixContiguityError`` naming the first violation.
    """
    output = response.get("output")
    if not isinstance(output, list):
        raise PrefixContiguityError("the response has no output list")
    sequence: list[int] = []
    bearing = 0
    generated_count = 0
    for index, item in enumerate(output):
        if not isinstance(item, Mapping):
            continue
        present = [name for name in REQUIRED_TOKEN_FIELDS if item.get(name) is not None]
        if not present:
            continue
        if len(present) != len(REQUIRED_TOKEN_FIELDS):
            raise PrefixContiguityError(
                f"output item {index} carries {present} but not all of {list(REQUIRED_TOKEN_FIELDS)}"
            )
        context = _int_list(item["prompt_token_ids"], "prompt_token_ids", index)
        generation = _int_list(item["generation_token_ids"], "generation_token_ids", index)
        log_probs = item["generation_log_probs"]
        if not isinstance(log_probs, list) or len(log_probs) != len(generation):
            raise PrefixContiguityError(
                f"output item {index} has {len(generation)} generated tokens but its log probs do not match"
            )
        if not generation:
            raise PrefixContiguityError(f"output item {index} carries token arrays but no generated token")
        if context[: len(sequence)] != sequence:
            raise PrefixContiguityError(
                f"output item {index}: prompt_token_ids does not extend the {len(sequence)} tokens of the "
                "items before it (prompts are cumulative)"
            )
        sequence = [*context, *generation]
        generated_count += len(generation)
        bearing += 1
    if bearing == 0:
        raise PrefixContiguityError("the response has no output item carrying token ids")
    usage = response.get("usage")
    generated = usage.get("output_tokens") if isinstance(usage, Mapping) else None
    if isinstance(generated, int) and generated != generated_count:
        raise PrefixContiguityError(
            f"the output items carry {generated_count} generated tokens but usage.output_tokens is {generated}; "
            "a token-bearing item was dropped or altered"
        )
    total = usage.get("total_tokens") if isinstance(usage, Mapping) else None
    if isinstance(total, int) and total != len(sequence):
        raise PrefixContiguityError(
            f"the output items concatenate to {len(sequence)} tokens but usage.total_tokens is {total}"
        )
    metadata = response.get("metadata")
    digest = metadata.get("tokcap_sequence_sha256") if isinstance(metadata, Mapping) else None
    if digest is not None and digest != token_sequence_digest(sequence):
        raise PrefixContiguityError(
            "the output items do not concatenate to the chain's token sequence (sha256 differs from "
            "metadata.tokcap_sequence_sha256); an item was altered, dropped or reordered"
        )
    return sequence

"""A rollout whose calls are stored as delta records, each continuing the one before, with the requests that
continue them: what a lineage resolver's kept state is tested against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokcap.lineage import stamp_continuation
from tokcap.log.records import ParentResolutionStatus, TokenEntry, compute_digest


@dataclass(frozen=True)
class DeltaChain:
    """``requests[k]`` continues call ``k - 1`` (``requests[0]`` is the root's); ``cumulative[k]`` is call k's."""

    entries: list[TokenEntry]
    requests: list[list[dict[str, Any]]]
    cumulative: list[tuple[int, ...]]


def delta_chain(rollout_id: str, calls: int, *, base: int = 0) -> DeltaChain:
    """``calls`` linked calls; ``base`` shifts every token, so two chains of one rollout id differ in tokens only
    (same call ids, same requests, same fingerprints)."""
    items: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    entries: list[TokenEntry] = []
    requests: list[list[dict[str, Any]]] = []
    cumulative: list[tuple[int, ...]] = []
    prompt = [base + 1, base + 2, base + 3]
    for call in range(calls):
        requests.append(list(items))
        output = {"role": "assistant", "content": f"turn {call}"}
        generation = [base + 100 + call, base + 200 + call]
        full = (*(cumulative[-1] if cumulative else ()), *prompt, *generation)
        parent = entries[-1].model_call_id if entries else None
        entry = TokenEntry(
            rollout_id=rollout_id,
            model_call_id=f"call-{call}",
            prompt_token_ids=prompt,
            generation_token_ids=generation,
            generation_log_probs=[-0.5, -0.25],
            output_items=[output],
            prompt_is_delta=parent is not None,
            parent_call_id=parent,
            parent_resolution=ParentResolutionStatus.RESOLVED if parent else ParentResolutionStatus.ROOT,
            cum_len=len(full),
            digest=compute_digest(list(full)),
        )
        stamp_continuation(entry, items)
        entries.append(entry)
        cumulative.append(full)
        items = [*items, output, {"role": "user", "content": f"result {call}"}]
        prompt = [base + 300 + call]
    requests.append(items)
    return DeltaChain(entries, requests, cumulative)

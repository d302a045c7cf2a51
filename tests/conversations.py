"""Multi-turn rollouts whose every prompt continues the previous call: what wire deltas are sent for."""

from __future__ import annotations

import random

from tokcap.log.records import TokenEntry

__all__ = ["conversation"]


def conversation(
    rollout_id: str, turns: int, *, prompt: int = 300, generated: int = 40, tool: int = 20, seed: int = 0
) -> list[TokenEntry]:
    """A rollout whose every prompt is the previous prompt, its generation and some tool tokens."""
    rng = random.Random(f"{rollout_id}:{seed}")
    context = [rng.randrange(150_000) for _ in range(prompt)]
    entries = []
    for turn in range(turns):
        generation = [rng.randrange(150_000) for _ in range(generated)]
        entries.append(
            TokenEntry(
                rollout_id=rollout_id,
                model_call_id=f"call-{turn}",
                model="policy",
                prompt_token_ids=list(context),
                generation_token_ids=generation,
                generation_log_probs=[-rng.random() * 4 for _ in generation],
                created_at=1_700_000_000.0 + turn,
            )
        )
        context += generation + [rng.randrange(150_000) for _ in range(tool)]
    return entries

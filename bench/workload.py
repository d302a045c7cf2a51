"""Synthetic multi-turn rollouts, seeded, so every trial and every reference sees the same entries.

Turn ``t`` of a rollout resends the whole conversation as its prompt: the system prompt, then every
earlier turn's generated tokens and tool output. That is what makes cost grow with rollout length.
Entries are built with ``TokenEntry.model_construct``: the arrays are valid by construction, and
validation belongs to the capture path, not to the transports measured here.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from bench.options import WorkloadShape
from tokcap.log.records import TokenEntry

__all__ = ["CREATED_AT", "VOCABULARY", "SyntheticRollout", "rollouts_of", "tokens_of"]

VOCABULARY = 151_936
"""Token ids are drawn below this, the size of a common open model's vocabulary."""

CREATED_AT = 1_700_000_000.0
"""Every entry's timestamp, so two trials write byte-identical entries."""


def tokens_of(entry: TokenEntry) -> int:
    """Tokens an entry carries: its whole prompt plus its generated tokens."""
    return len(entry.prompt_token_ids) + len(entry.generation_token_ids)


@dataclass(frozen=True)
class SyntheticRollout:
    """One rollout's identity and the seed of its token streams."""

    rollout_id: str
    slot: int
    round: int
    shape: WorkloadShape

    def entries(self) -> Iterator[TokenEntry]:
        """The rollout's entries in turn order; each prompt extends the previous turn's conversation."""
        shape = self.shape
        rng = random.Random(f"{shape.seed}:{self.slot}:{self.round}")
        conversation = [rng.randrange(VOCABULARY) for _ in range(shape.prompt_tokens)]
        for turn in range(shape.turns):
            generated = [rng.randrange(VOCABULARY) for _ in range(shape.generated_tokens)]
            log_probs = [-8.0 * rng.random() for _ in range(shape.generated_tokens)]
            yield TokenEntry.model_construct(
                rollout_id=self.rollout_id,
                model_call_id=f"call-{turn:04d}",
                model="bench-model",
                prompt_token_ids=list(conversation),
                generation_token_ids=generated,
                generation_log_probs=log_probs,
                created_at=CREATED_AT,
            )
            conversation.extend(generated)
            conversation.extend(rng.randrange(VOCABULARY) for _ in range(shape.tool_tokens))


def rollouts_of(shape: WorkloadShape, prefix: str) -> list[list[SyntheticRollout]]:
    """Per concurrent slot, the rollouts it runs one after another; ids start with ``prefix``."""
    return [
        [
            SyntheticRollout(f"{prefix}-s{slot:03d}-r{round_:02d}", slot, round_, shape)
            for round_ in range(shape.rounds)
        ]
        for slot in range(shape.rollouts)
    ]

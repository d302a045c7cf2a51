"""What a builder returns: chains of model calls, the notes on what was left out, and the two together.

A ``Chain`` is a path of model calls in which each call's prompt is the previous call's prompt and
generation followed by interstitial tokens; ``tokcap.builder`` builds them and ``tokcap.response_items`` turns one
into a response. Both read these types from here, so neither imports the other to name them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokcap.errors import ChainValidationError
from tokcap.log.records import TokenEntry

__all__ = ["BuildNotes", "BuildOutput", "Chain", "ChainLink", "ChainTokens"]


@dataclass(frozen=True)
class ChainLink:
    """One model call in a chain and the tokens that came between the previous call and this one.

    For the first link ``interstitial_token_ids`` is empty: its whole prompt is the chain's root prompt.
    """

    entry: TokenEntry
    interstitial_token_ids: tuple[int, ...] = ()

    @property
    def interstitial(self) -> list[int]:
        """Gym's name for ``interstitial_token_ids``."""
        return list(self.interstitial_token_ids)


@dataclass(frozen=True)
class ChainTokens:
    """A chain flattened for training: one value per token of the final sequence."""

    token_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]


@dataclass(frozen=True)
class Chain:
    """A path of model calls whose prompts extend each other; ``chain_id`` is the last call's id."""

    chain_id: str
    root_prompt_token_ids: tuple[int, ...]
    links: tuple[ChainLink, ...]

    @property
    def root_prompt(self) -> list[int]:
        """Gym's name for ``root_prompt_token_ids``."""
        return list(self.root_prompt_token_ids)

    @property
    def call_ids(self) -> tuple[str, ...]:
        """The model call ids of the links, first to last."""
        return tuple(link.entry.model_call_id for link in self.links)

    @property
    def generated_token_count(self) -> int:
        """How many tokens the policy generated along the chain."""
        return sum(len(link.entry.generation_token_ids) for link in self.links)

    def validate(self) -> None:
        """Raise ``ChainValidationError`` unless every link's prompt extends the previous link exactly.

        The first link's prompt must equal the root prompt; each later prompt must be the previous prompt,
        then the previous generation, then the link's interstitial tokens.
        """
        if not self.links:
            raise ChainValidationError(f"chain {self.chain_id!r} has no links")
        first = self.links[0]
        if first.interstitial_token_ids:
            raise ChainValidationError(
                f"chain {self.chain_id!r}: its first call {first.entry.model_call_id!r} has interstitial tokens; "
                "a root's whole prompt belongs in root_prompt_token_ids"
            )
        if first.entry.prompt_token_ids != list(self.root_prompt_token_ids):
            raise ChainValidationError(
                f"chain {self.chain_id!r}: the prompt of its first call {first.entry.model_call_id!r} differs "
                "from the chain's root prompt"
            )
        rollout_id = first.entry.rollout_id
        previous: TokenEntry | None = None
        for link in self.links:
            entry = link.entry
            if entry.rollout_id != rollout_id:
                raise ChainValidationError(
                    f"chain {self.chain_id!r} mixes rollouts {rollout_id!r} and {entry.rollout_id!r}",
                    rollout_id=rollout_id,
                    model_call_id=entry.model_call_id,
                )
            if not entry.generation_token_ids:
                raise ChainValidationError(
                    f"chain {self.chain_id!r}: call {entry.model_call_id!r} generated no tokens",
                    rollout_id=rollout_id,
                    model_call_id=entry.model_call_id,
                )
            if previous is None:
                previous = entry
                continue
            prompt = entry.prompt_token_ids
            prompt_end = len(previous.prompt_token_ids)
            generation_end = prompt_end + len(previous.generation_token_ids)
            if (
                prompt[:prompt_end] != previous.prompt_token_ids
                or prompt[prompt_end:generation_end] != previous.generation_token_ids
                or prompt[generation_end:] != list(link.interstitial_token_ids)
            ):
                raise ChainValidationError(
                    f"chain {self.chain_id!r}: the prompt of call {entry.model_call_id!r} is not the prompt and "
                    f"generation of call {previous.model_call_id!r} followed by its interstitial tokens",
                    rollout_id=rollout_id,
                    model_call_id=entry.model_call_id,
                )
            previous = entry

    def training_tokens(self) -> ChainTokens:
        """The final token sequence with its loss mask (1 on generated tokens) and log probs (0.0 elsewhere)."""
        token_ids: list[int] = []
        loss_mask: list[int] = []
        log_probs: list[float] = []
        for index, link in enumerate(self.links):
            context = list(self.root_prompt_token_ids) if index == 0 else list(link.interstitial_token_ids)
            generation = link.entry.generation_token_ids
            token_ids.extend(context)
            token_ids.extend(generation)
            loss_mask.extend([0] * len(context))
            loss_mask.extend([1] * len(generation))
            log_probs.extend([0.0] * len(context))
            log_probs.extend(link.entry.generation_log_probs)
        return ChainTokens(token_ids=token_ids, loss_mask=loss_mask, log_probs=log_probs)


@dataclass(frozen=True)
class BuildNotes:
    """What a build saw and kept, for metrics and for deciding whether to mask.

    ``unresolved_retries`` lists each group of same-prompt siblings that no later call extends (all their ids).
    ``discarded_retries`` lists siblings dropped because another sibling with the same prompt was extended.
    ``empty_generation_calls`` lists calls excluded because they generated no tokens.
    """

    builder: str
    roots: int
    chains: int
    generated_tokens_captured: int
    generated_tokens_delivered: int
    unresolved_retries: tuple[tuple[str, ...], ...] = ()
    discarded_retries: tuple[str, ...] = ()
    empty_generation_calls: tuple[str, ...] = ()
    # Gym's terminal verdict: "" (no terminal named), "delivered" (the main chain ends at it),
    # "broken" (it is quarantined), "not_captured" (no buildable call has that id).
    terminal_call_id: str | None = None
    terminal_chain: str = ""
    # Lineage builds only (``lineage``): why recorded parent links were not used, by Gym's note names,
    # and the calls that start a fragment after a parent they could not prove.
    lineage: bool = False
    parent_link_failures: Mapping[str, int] = field(default_factory=dict)
    unresolved_parent_calls: tuple[str, ...] = ()

    @property
    def delivered_fraction(self) -> float:
        """Share of captured generated tokens that the delivered chains carry; 0.0 when nothing was captured."""
        if self.generated_tokens_captured == 0:
            return 0.0
        return self.generated_tokens_delivered / self.generated_tokens_captured

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form for metrics."""
        return {
            "builder": self.builder,
            "roots": self.roots,
            "chains": self.chains,
            "generated_tokens_captured": self.generated_tokens_captured,
            "generated_tokens_delivered": self.generated_tokens_delivered,
            "delivered_fraction": self.delivered_fraction,
            "unresolved_retries": [list(group) for group in self.unresolved_retries],
            "discarded_retries": list(self.discarded_retries),
            "empty_generation_calls": list(self.empty_generation_calls),
            "terminal_call_id": self.terminal_call_id,
            "terminal_chain": self.terminal_chain,
            "lineage": self.lineage,
            "parent_link_failures": dict(self.parent_link_failures),
            "unresolved_parent_calls": list(self.unresolved_parent_calls),
        }


@dataclass(frozen=True)
class BuildOutput:
    """The chains of one rollout; the main chain first, then its branches.

    ``main_chain_id`` is ``None`` for builders that deliver every chain (``per_request``).
    ``quarantined_call_ids`` are calls whose parent was ambiguous, with everything that extends them.
    """

    chains: tuple[Chain, ...]
    notes: BuildNotes
    main_chain_id: str | None = None
    branch_chain_ids: tuple[str, ...] = ()
    quarantined_call_ids: tuple[str, ...] = field(default_factory=tuple)

    @property
    def quarantined(self) -> list[str]:
        """Gym's name for ``quarantined_call_ids``."""
        return list(self.quarantined_call_ids)

    @property
    def main_chain(self) -> Chain | None:
        """The chain delivered as the rollout's trajectory, if the builder names one."""
        for chain in self.chains:
            if chain.chain_id == self.main_chain_id:
                return chain
        return None

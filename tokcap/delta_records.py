"""Delta records: a continuation stored as the prompt suffix after its proven parent (Gym's ``prompt_is_delta``).

Writing: ``store_as_delta`` turns a RESOLVED call's entry into its suffix, but only when its prompt starts
with the exact tokens of the parent the resolver proved; otherwise the entry keeps its full prompt, so every
chain still ends at a full-prompt anchor. The digest and ``cum_len`` always describe the full sequence.

Reading: ``rebuild_full_prompts`` walks each delta's parent links back to a full-prompt anchor, joins the
tokens, and checks the result against the digest the writer stored. A link is never trusted: a missing
parent, a cycle, or a digest that differs leaves the entry out and names it, and the reader masks what
depended on it instead of training on a guessed prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokcap.log.records import TokenEntry, compute_digest

__all__ = ["FullPrompts", "LineageReport", "lineage_report", "rebuild_full_prompts", "store_as_delta"]

_MAX_DEPTH = 100_000
"""Longer parent walks are treated as broken: no real rollout has that many calls in one chain."""


def store_as_delta(entry: TokenEntry, parent_cumulative: Sequence[int]) -> list[int] | None:
    """Cut ``entry``'s prompt to the suffix after ``parent_cumulative`` and return its full sequence.

    Return ``None`` and leave the entry untouched when it is already a delta, when the parent has no
    tokens, or when the prompt does not start with the parent's tokens (a compacted or rewritten prompt).
    The caller stamps the lineage with the returned full sequence, so the digest stays the full one's.
    """
    parent = list(parent_cumulative)
    prompt = entry.prompt_token_ids
    if entry.prompt_is_delta or not parent or len(prompt) < len(parent) or prompt[: len(parent)] != parent:
        return None
    cumulative = [*prompt, *entry.generation_token_ids]
    entry.prompt_token_ids = prompt[len(parent) :]
    entry.prompt_is_delta = True
    return cumulative


@dataclass(frozen=True)
class FullPrompts:
    """The snapshot with every delta prompt rebuilt, and the delta calls that could not be.

    ``entries`` keeps the input order and holds full-prompt entries only (rebuilt ones are copies).
    ``broken`` names, in input order, each delta call whose chain is missing a link, loops, passes
    through a mismatched record, or rebuilds to tokens its stored digest does not match.
    ``mismatched`` names each full-prompt call whose own tokens disagree with its stored digest (Gym
    keeps such a record; tokcap leaves it out, since its tokens are not the ones that were captured).
    """

    entries: tuple[TokenEntry, ...]
    broken: tuple[str, ...]
    mismatched: tuple[str, ...] = ()


def _sequence(entry: TokenEntry) -> list[int]:
    return [*entry.prompt_token_ids, *entry.generation_token_ids]


def _digest_holds(entry: TokenEntry) -> bool:
    """A full-prompt record without a digest cannot be checked; one with a digest must match its tokens."""
    return not entry.digest or compute_digest(_sequence(entry)) == entry.digest


def rebuild_full_prompts(entries: Sequence[TokenEntry]) -> FullPrompts:
    """Give every delta entry its full prompt by walking parent links to a full-prompt anchor.

    The last entry seen for a call id is the one its children are rebuilt from; callers deduplicate first.
    A full-prompt entry is an anchor when its digest (if any) matches its tokens. A rebuilt entry is kept
    only when the digest it carries matches the rebuilt prompt and generation (an entry without a digest
    cannot be checked and is kept, as Gym keeps it).
    """
    by_call = {entry.model_call_id: entry for entry in entries}
    known: dict[str, list[int] | None] = {}

    def sequence_of(call_id: str) -> list[int] | None:
        walk: list[TokenEntry] = []
        seen: set[str] = set()
        current = call_id
        anchor: list[int] | None = None
        while True:
            if current in known:
                anchor = known[current]
                break
            entry = by_call.get(current)
            if entry is None or current in seen or len(walk) > _MAX_DEPTH:
                anchor = None
                break
            seen.add(current)
            if not entry.prompt_is_delta:
                anchor = _sequence(entry) if _digest_holds(entry) else None
                known[current] = anchor
                break
            walk.append(entry)
            if entry.parent_call_id is None:
                anchor = None
                break
            current = entry.parent_call_id
        for entry in reversed(walk):
            if anchor is not None:
                anchor = [*anchor, *entry.prompt_token_ids, *entry.generation_token_ids]
            known[entry.model_call_id] = anchor
        return known.get(call_id)

    rebuilt: list[TokenEntry] = []
    broken: list[str] = []
    mismatched: list[str] = []
    for entry in entries:
        if not entry.prompt_is_delta:
            if _digest_holds(entry):
                rebuilt.append(entry)
            else:
                mismatched.append(entry.model_call_id)
            continue
        sequence = sequence_of(entry.model_call_id)
        if sequence is None or (entry.digest and compute_digest(sequence) != entry.digest):
            broken.append(entry.model_call_id)
            continue
        prompt = sequence[: len(sequence) - len(entry.generation_token_ids)]
        rebuilt.append(entry.model_copy(update={"prompt_token_ids": prompt, "prompt_is_delta": False}))
    return FullPrompts(entries=tuple(rebuilt), broken=tuple(broken), mismatched=tuple(mismatched))


@dataclass(frozen=True)
class LineageReport:
    """What a reader shows about a rollout's records: which are deltas, and what their full prompts are.

    ``full_prompt_tokens`` maps each call whose full prompt could be rebuilt (or was stored) to its length;
    ``unrebuildable`` and ``digest_mismatches`` are ``FullPrompts.broken`` and ``.mismatched``.
    """

    delta_records: int
    full_prompt_tokens: dict[str, int]
    unrebuildable: tuple[str, ...]
    digest_mismatches: tuple[str, ...]

    @property
    def sound(self) -> bool:
        """Whether every record's full prompt was rebuilt and matched its digest."""
        return not self.unrebuildable and not self.digest_mismatches

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form for ``tokcap inspect``, ``log`` and ``replay``."""
        return {
            "delta_records": self.delta_records,
            "full_prompt_tokens": dict(self.full_prompt_tokens),
            "unrebuildable": list(self.unrebuildable),
            "digest_mismatches": list(self.digest_mismatches),
            "sound": self.sound,
        }


def lineage_report(entries: Sequence[TokenEntry]) -> LineageReport:
    """Rebuild and check a rollout's records as the builder does, and say what a reader should show."""
    rebuilt = rebuild_full_prompts(entries)
    return LineageReport(
        delta_records=sum(1 for entry in entries if entry.prompt_is_delta),
        full_prompt_tokens={entry.model_call_id: len(entry.prompt_token_ids) for entry in rebuilt.entries},
        unrebuildable=rebuilt.broken,
        digest_mismatches=rebuilt.mismatched,
    )

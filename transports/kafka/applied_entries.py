"""The entries a materializer applied, per rollout and in file order, kept so a freeze answered ahead copies them.

Answering a freeze ahead of its apply (``TokenCaptureStore.snapshot_ahead``) needs the rollout's entries applied
so far. Read from its file, each costs a parse (about 260 us for a 3k-token line); the materializer already
holds them, decoded from the log, and a copy that is exactly what the parse gives costs less than half of that.
The entries kept are the router's own decoded objects, private to the materializer: nothing else holds or
changes them. A put counts only when the store accepted it (it appended its line). A retire or delete forgets
the rollout; so does the bound, oldest rollout first. A list that misses entries (applied before this process
started, or forgotten) is refused by the store's check against the rollout's state, which then parses.
"""

from __future__ import annotations

from collections import OrderedDict

from tokcap.events import DeleteEvent, Event, PutEvent, RetireEvent
from tokcap.records import TokenEntry, token_count
from tokcap.rules import ApplyOutcome, ApplyResult

__all__ = ["DEFAULT_KEPT_TOKENS", "AppliedEntries"]

DEFAULT_KEPT_TOKENS = 2_000_000
"""Prompt and generated tokens kept over every rollout, about 70 MB of Python ints."""


class AppliedEntries:
    """Per rollout, the entries whose puts the store accepted, in the order their lines were appended."""

    def __init__(self, max_tokens: int = DEFAULT_KEPT_TOKENS) -> None:
        self._max_tokens = max_tokens
        self._kept: OrderedDict[str, list[TokenEntry]] = OrderedDict()
        self._tokens: dict[str, int] = {}
        self._total = 0

    def note(self, event: Event, result: ApplyResult) -> None:
        """Take the verdict of one applied event into account."""
        rollout_id = event.rollout_id
        if isinstance(event, RetireEvent | DeleteEvent):
            self._forget(rollout_id)
        elif isinstance(event, PutEvent) and result.outcome is ApplyOutcome.ACCEPTED:
            entry = event.entry
            tokens = token_count(entry)
            self._kept.setdefault(rollout_id, []).append(entry)
            self._kept.move_to_end(rollout_id)
            self._tokens[rollout_id] = self._tokens.get(rollout_id, 0) + tokens
            self._total += tokens
            while self._total > self._max_tokens and self._kept:
                self._forget(next(iter(self._kept)))

    def of(self, rollout_id: str) -> list[TokenEntry] | None:
        """The rollout's kept entries in file order; ``None`` when none are kept."""
        return self._kept.get(rollout_id)

    @property
    def kept_tokens(self) -> int:
        """Tokens currently kept."""
        return self._total

    def _forget(self, rollout_id: str) -> None:
        self._kept.pop(rollout_id, None)
        self._total -= self._tokens.pop(rollout_id, 0)

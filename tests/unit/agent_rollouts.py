"""Synthetic multi-turn agent rollouts: each call's prompt is the running context of the conversation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tests.factories import assistant_message_item, make_entry
from tokcap.log.records import TokenEntry


@dataclass
class AgentRollout:
    """Records the entries an agent's model calls would produce, with increasing ``created_at``."""

    rollout_id: str
    context: list[int]
    entries: list[TokenEntry] = field(default_factory=list)
    clock: float = 1000.0

    def _entry(self, call_id: str, generation: Sequence[int]) -> TokenEntry:
        self.clock += 1.0
        entry = make_entry(
            self.rollout_id,
            call_id,
            list(self.context),
            list(generation),
            output_items=[assistant_message_item(f"reply of {call_id}", item_id=f"msg_{call_id}")],
            created_at=self.clock,
        )
        self.entries.append(entry)
        return entry

    def attempt(self, call_id: str, generation: Sequence[int]) -> TokenEntry:
        """A call whose output the agent throws away (a retry); the context does not move."""
        return self._entry(call_id, generation)

    def turn(self, call_id: str, generation: Sequence[int], then: Sequence[int] = ()) -> TokenEntry:
        """A call the agent keeps; the context grows by its generation and the tokens that follow it."""
        entry = self._entry(call_id, generation)
        self.context = [*self.context, *generation, *then]
        return entry

    def compact(self, new_context: Sequence[int]) -> None:
        """Replace the context, as a summarizing agent does; later calls extend nothing earlier."""
        self.context = list(new_context)

    def entry(self, call_id: str) -> TokenEntry:
        return next(e for e in self.entries if e.model_call_id == call_id)

    def without(self, *call_ids: str) -> list[TokenEntry]:
        return [e for e in self.entries if e.model_call_id not in call_ids]

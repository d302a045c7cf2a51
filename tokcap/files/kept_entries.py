"""The entries a file store's own puts appended, kept in memory so the rollout's freeze need not parse its file.

A freeze answers with every entry of its rollout. Reading them back from the entries file costs a parse per
line (about 220 us for a 3k-token line: orjson, then pydantic), and a trainer freezes a whole round of
rollouts in the same instant, so a burst of 64 freezes of 8 entries spent about 110 ms parsing. The store
already holds each entry when it appends its line, so it keeps an exact copy (``fresh_read_copy``: equal in
every detail to what parsing the line gives, sharing nothing mutable with the caller) and the freeze takes the
copies instead of parsing.

Rules:

- Only lines the store appended one after another from the start of the file are kept. A line appended at any
  other offset (another process wrote in between, or the file was cut) forgets the rollout.
- Taking is checked against the state the freeze decided on, which the store recovered from the files: the
  kept lines must cover exactly ``indexed_size`` bytes and hold exactly the state's calls with the state's
  digests (the sha256 of each line). Anything else returns ``None`` and the caller parses the file.
- Taking hands the copies over and forgets the rollout: only the first freeze gains, and memory is freed as
  soon as it is answered. Removing or cutting a rollout's files forgets it too.
- The kept tokens are bounded (``KEPT_ENTRY_TOKENS`` by default). Past the bound, the rollout appended to
  least recently is forgotten first; a forgotten rollout's freeze parses its file as before.

Every method is safe from any thread: the store calls them under the rollout's lock, and a lock of this
module's own guards what rollouts share (the map and the token count).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from tokcap.files.entry_copies import fresh_read_copy
from tokcap.log.records import TokenEntry, token_count
from tokcap.log.state import RolloutState

__all__ = ["KEPT_ENTRY_TOKENS", "KeptEntries"]

KEPT_ENTRY_TOKENS = 2_000_000
"""Prompt plus generated tokens a store keeps at most for its freezes (about 40 bytes each at worst)."""


@dataclass(slots=True)
class _KeptRollout:
    """One rollout's kept copies, in file order, and the bytes of the entries file their lines cover."""

    entries: list[TokenEntry] = field(default_factory=list)
    digests: list[tuple[str, str]] = field(default_factory=list)
    size: int = 0
    tokens: int = 0


class KeptEntries:
    """Per rollout, exact copies of the entries whose lines the store appended, bounded by a token budget."""

    def __init__(self, token_budget: int = KEPT_ENTRY_TOKENS) -> None:
        if token_budget < 0:
            raise ValueError(f"token_budget must be 0 or more, got {token_budget}")
        self._budget = token_budget
        self._rollouts: OrderedDict[str, _KeptRollout] = OrderedDict()
        self._tokens = 0
        self._guard = threading.Lock()

    @property
    def tokens(self) -> int:
        """Prompt plus generated tokens kept now, over every rollout."""
        return self._tokens

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._rollouts

    def appended(self, rollout_id: str, entry: TokenEntry, start: int, line_length: int, digest: str) -> None:
        """Note that ``entry``'s line of ``line_length`` bytes and sha256 ``digest`` now sits at byte ``start``.

        A line at the start of the file begins the rollout afresh. A line anywhere but right after the kept
        ones forgets the rollout, and so does an entry ``fresh_read_copy`` cannot copy exactly.
        """
        if self._budget == 0:
            return
        copy = fresh_read_copy(entry)
        with self._guard:
            kept = self._rollouts.get(rollout_id)
            if start == 0 and kept is not None:
                self._drop_locked(rollout_id)
                kept = None
            if copy is None or (kept is None and start != 0) or (kept is not None and kept.size != start):
                self._drop_locked(rollout_id)
                return
            if kept is None:
                kept = self._rollouts[rollout_id] = _KeptRollout()
            else:
                self._rollouts.move_to_end(rollout_id)
            tokens = token_count(copy)
            kept.entries.append(copy)
            kept.digests.append((copy.model_call_id, digest))
            kept.size = start + line_length
            kept.tokens += tokens
            self._tokens += tokens
            while self._tokens > self._budget and self._rollouts:
                self._drop_locked(next(iter(self._rollouts)))

    def take(self, rollout_id: str, state: RolloutState) -> list[TokenEntry] | None:
        """Hand over the rollout's copies if they are exactly the entries ``state`` indexes; forget them either way.

        ``None`` means the caller must parse the file: nothing was kept, or the files hold lines this store
        did not append in this order.
        """
        with self._guard:
            kept = self._rollouts.get(rollout_id)
            if kept is None:
                return None
            self._drop_locked(rollout_id)
        if kept.size != state.indexed_size or len(kept.digests) != len(state.entry_digests):
            return None
        stored = state.entry_digests
        if any(stored.get(call_id) != digest for call_id, digest in kept.digests):
            return None
        return kept.entries

    def forget(self, rollout_id: str) -> None:
        """Drop what is kept of a rollout whose files were removed or cut."""
        if rollout_id in self._rollouts:
            with self._guard:
                self._drop_locked(rollout_id)

    def _drop_locked(self, rollout_id: str) -> None:
        kept = self._rollouts.pop(rollout_id, None)
        if kept is not None:
            self._tokens -= kept.tokens

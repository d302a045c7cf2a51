"""What a Kafka sink remembers of the puts it sent, so a continuation can travel as (parent link, suffix).

A put is remembered only once the broker acknowledged it, and only when it went as one message: the link
names that message's partition and offset, which every reader can read again. A later put of the same
rollout whose prompt starts with a remembered call's prompt and generation, token for token, is sent as a
wire delta against the longest such call; anything this sink cannot prove (a call another process sent, a
send that failed or is still in flight, a chunked message) is simply not a candidate, and the put goes
whole. Memory is bounded by rollouts, calls per rollout and tokens; forgetting only costs a full send.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tokcap.log.events import PutEvent
from tokcap.log.records import TokenEntry
from transports.kafka.wire.codec import (
    DEFAULT_CHUNK_BYTES,
    OutgoingMessage,
    ParentLink,
    encode_delta_message,
    encode_event_messages,
)
from transports.kafka.wire.topic_limits import TOPIC_DEFAULTS, TopicLimits

__all__ = [
    "DEFAULT_CALLS_PER_ROLLOUT",
    "DEFAULT_MIN_PREFIX_TOKENS",
    "DEFAULT_REMEMBERED_TOKENS",
    "SentCalls",
    "encode_put",
]

DEFAULT_CALLS_PER_ROLLOUT = 2
"""Calls kept per rollout: the latest, and the one before it for a retried or branched turn."""

DEFAULT_MIN_PREFIX_TOKENS = 64
"""A shorter shared prefix saves less than the parent link costs; such puts go whole."""

DEFAULT_REMEMBERED_TOKENS = 4_000_000
"""Tokens kept over every rollout; the least recently used rollouts are forgotten first.

A call is kept as a list sharing the entry's int objects (8 bytes a token, plus the ints it keeps alive).
"""


@dataclass(frozen=True)
class _SentCall:
    partition: int
    offset: int
    model_call_id: str
    sequence: list[int]
    """The call's prompt then generation, as sent (a copy: the caller may reuse its lists)."""


class SentCalls:
    """The acknowledged single-message puts of recent rollouts, and the parent a new put can be cut after."""

    def __init__(
        self,
        *,
        calls_per_rollout: int = DEFAULT_CALLS_PER_ROLLOUT,
        min_prefix_tokens: int = DEFAULT_MIN_PREFIX_TOKENS,
        max_tokens: int = DEFAULT_REMEMBERED_TOKENS,
    ) -> None:
        self._calls_per_rollout = calls_per_rollout
        self._min_prefix_tokens = min_prefix_tokens
        self._max_tokens = max_tokens
        self._rollouts: OrderedDict[str, list[_SentCall]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens currently remembered."""
        return self._tokens

    def parent_for(self, entry: TokenEntry) -> ParentLink | None:
        """The remembered call of the entry's rollout whose prompt and generation start the entry's prompt.

        The longest one wins; a call with the entry's own id never does (a repeated put is sent whole).
        """
        with self._lock:
            calls = list(self._rollouts.get(entry.rollout_id, ()))
        prompt = entry.prompt_token_ids
        best: _SentCall | None = None
        for call in calls:
            length = len(call.sequence)
            if call.model_call_id == entry.model_call_id or length > len(prompt):
                continue
            if length < self._min_prefix_tokens or (best is not None and length <= len(best.sequence)):
                continue
            # A prompt built by extending the last one shares its int objects: the comparison is a pointer walk.
            if prompt[:length] == call.sequence:
                best = call
        if best is None:
            return None
        return ParentLink(best.partition, best.offset, best.model_call_id, len(best.sequence))

    def remember(self, entry: TokenEntry, partition: int, offset: int) -> None:
        """Keep an acknowledged single-message put as a parent for the rollout's next puts."""
        sequence = [*entry.prompt_token_ids, *entry.generation_token_ids]
        if len(sequence) > self._max_tokens:
            return
        call = _SentCall(partition, offset, entry.model_call_id, sequence)
        with self._lock:
            kept = []
            for earlier in self._rollouts.pop(entry.rollout_id, []):
                if earlier.model_call_id == entry.model_call_id:
                    self._tokens -= len(earlier.sequence)
                else:
                    kept.append(earlier)
            kept.append(call)
            self._tokens += len(sequence)
            while len(kept) > self._calls_per_rollout:
                self._tokens -= len(kept.pop(0).sequence)
            self._rollouts[entry.rollout_id] = kept
            while self._tokens > self._max_tokens and self._rollouts:
                _, dropped = self._rollouts.popitem(last=False)
                self._tokens -= sum(len(c.sequence) for c in dropped)

    def forget(self, rollout_id: str) -> None:
        """Forget a rollout's calls (its puts may no longer be provable from this sink)."""
        with self._lock:
            dropped = self._rollouts.pop(rollout_id, [])
            self._tokens -= sum(len(c.sequence) for c in dropped)


def encode_put(
    event: PutEvent,
    sent: SentCalls | None,
    *,
    next_chunk_group: Callable[[], str],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    limits: TopicLimits = TOPIC_DEFAULTS,
    entry_digest: str | None = None,
) -> list[OutgoingMessage]:
    """The messages a sink sends for a put: one wire delta when ``sent`` proves a parent and it fits one
    message, else the put whole (chunked above ``chunk_bytes``). ``entry_digest`` saves computing the
    entry's ``payload_digest`` again when the caller has it."""
    if sent is not None:
        link = sent.parent_for(event.entry)
        if link is not None:
            message = encode_delta_message(event, link, entry_digest=entry_digest)
            if len(message.value) <= chunk_bytes:
                return [message]
    return encode_event_messages(
        event, chunk_bytes=chunk_bytes, limits=limits, next_chunk_group=next_chunk_group
    )

"""What the inbound router decides a message (or an abandoned chunk group) is: the decisions every reader carries out.

Every decision has a log position: the offset of the message whose routing took it, and its ``index`` among the
decisions about the same rollout routing that message took, in their order (``router``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tokcap.log.events import LOG_READER_WRITER, Event, IncompleteEvent, LogPosition
from transports.kafka.wire.dead_letter_reason import REASON_LIMIT
from transports.kafka.wire.messages import LogMessage, rollout_of_key

__all__ = [
    "MATERIALIZER_WRITER",
    "ApplyEvent",
    "Buffered",
    "DeadLetter",
    "Deferred",
    "Routed",
    "dead_letter",
    "rollout_of",
]

MATERIALIZER_WRITER = LOG_READER_WRITER
"""Writer id of the incomplete markers the materializer itself applies."""


@dataclass(frozen=True)
class ApplyEvent:
    """Apply ``event`` at this position; ``size`` counts every chunk of a reassembled event."""

    event: Event
    partition: int
    offset: int
    headers: Mapping[str, str]
    size: int
    index: int = 0

    def position(self, topic: str) -> LogPosition:
        """Where the event is decided: its message (the last chunk of a group), at its index."""
        return LogPosition(topic, self.partition, self.offset, self.index)


@dataclass(frozen=True)
class Buffered:
    """A chunk kept until the rest of its group arrives."""

    partition: int
    offset: int
    headers: Mapping[str, str]
    size: int
    detail: str


@dataclass(frozen=True)
class DeadLetter:
    """A message, or an abandoned chunk group (at its first chunk's offset), that cannot be applied.

    ``mask`` marks the rollout the key names incomplete, at the position of the decision: ``decided_at`` is
    the offset of the message whose routing took it (the message itself, or the one that abandoned the group).
    """

    partition: int
    offset: int
    headers: Mapping[str, str]
    size: int
    reason: str
    rollout_id: str | None
    mask: IncompleteEvent | None
    decided_at: int
    index: int = 0

    @property
    def abandoned(self) -> bool:
        """An abandoned chunk group, not the message being routed: its first chunk came before that message."""
        return self.offset != self.decided_at

    def position(self, topic: str) -> LogPosition:
        """Where the mask is decided: the routed message, at the decision's index."""
        return LogPosition(topic, self.partition, self.decided_at, self.index)


@dataclass(eq=False)
class Deferred:
    """A whole capture message routed by its headers and key only; ``InboundRouter.settle`` decodes it.

    ``decided`` is what it settled to; until then ``message`` holds its bytes.
    """

    partition: int
    offset: int
    headers: Mapping[str, str]
    size: int
    rollout_id: str
    message: LogMessage | None
    decided: ApplyEvent | DeadLetter | None = None
    decoded_ahead: bool = False
    """Decoded by ``settle_oldest`` before anything asked for it; counted in ``decoded_ahead_tokens``."""


Routed = ApplyEvent | Buffered | DeadLetter
"""What one message, or one abandoned group, becomes."""


def dead_letter(message: LogMessage, headers: Mapping[str, str], size: int, reason: str) -> DeadLetter:
    """A message that cannot be applied; the rollout its key names is masked at the message's position."""
    rollout_id = rollout_of_key(message.key)
    mask = None
    if rollout_id is not None:
        where = f"partition {message.partition} offset {message.offset}"
        mask = IncompleteEvent(
            rollout_id=rollout_id,
            writer=MATERIALIZER_WRITER,
            reason=f"dead-lettered event at {where}: {reason}"[:REASON_LIMIT],
        )
    return DeadLetter(
        message.partition,
        message.offset,
        headers,
        size,
        reason,
        rollout_id,
        mask,
        decided_at=message.offset,
    )


def rollout_of(decided: Routed | Deferred) -> str | None:
    """The rollout whose files a decision changes; ``None`` for a chunk kept or a message that names none."""
    if isinstance(decided, ApplyEvent):
        return decided.event.rollout_id
    if isinstance(decided, DeadLetter | Deferred):
        return decided.rollout_id
    return None

"""What the materializer loop counts as it goes: events applied, dead letters and masked rollouts by kind, and
how long commands wait for their answer and blocks take to flush (what explains a long freeze pause).

The families live in ``tokcap.metrics``; this module turns the loop's routing decisions and verdicts into
their bounded labels. A dead letter's reason is free text (it names offsets and groups), so its kind is read
from the decision's shape and the reason's fixed opening words, never used as a label itself.
"""

from __future__ import annotations

from collections.abc import Callable

from tokcap.log.events import EventType, FreezeEvent
from tokcap.log.rules import ApplyOutcome, ApplyResult
from tokcap.log.state import RolloutState
from tokcap.metrics import (
    BLOCK_KINDS,
    COMMAND_KINDS,
    COMMAND_READ_DELAY_SECONDS,
    COMMAND_WAIT_SECONDS,
    DEAD_LETTERS,
    EVENTS_APPLIED,
    FLUSH_SECONDS,
    FREEZE_SECONDS,
    ROLLOUTS_MASKED,
)
from transports.kafka.wire.router import ApplyEvent, DeadLetter, Routed

__all__ = [
    "count_applied",
    "count_dead_letter",
    "dead_letter_kind",
    "observe_command_read_delay",
    "observe_command_wait",
    "observe_flush",
    "observe_freeze",
]

_APPLIED = {event_type: EVENTS_APPLIED.labels(event_type.value) for event_type in EventType}
"""One bound child per event type: counting an event is one increment, no label lookup."""

_COMMAND_WAITS = {kind: COMMAND_WAIT_SECONDS.labels(kind) for kind in COMMAND_KINDS}
_COMMAND_READ_DELAYS = {kind: COMMAND_READ_DELAY_SECONDS.labels(kind) for kind in COMMAND_KINDS}
_FLUSHES = {kind: FLUSH_SECONDS.labels(kind) for kind in BLOCK_KINDS}


_DEAD_LETTER_MARKS = ("dead-lettered event at ", "orphaned chunk group ")
"""How the router's masks for a dead letter begin (``router.InboundRouter``): a mark a writer sent does not."""


def dead_letter_kind(routed: Routed) -> str:
    """The kind (one of ``tokcap.metrics.DEAD_LETTER_KINDS``) of a decision that was dead-lettered."""
    if isinstance(routed, ApplyEvent):
        return "refused_staging"
    if isinstance(routed, DeadLetter) and routed.abandoned:
        return "abandoned_chunk_group"
    reason = routed.reason if isinstance(routed, DeadLetter) else ""
    if reason.startswith("orphaned chunk "):
        return "orphaned_chunk"
    if "does not continue group" in reason or "reassembles to a different digest" in reason:
        return "broken_chunk_group"
    return "undecodable"


def count_dead_letter(routed: Routed) -> None:
    """Count one dead-letter line written for this decision."""
    DEAD_LETTERS.labels(dead_letter_kind(routed)).inc()


def count_applied(
    state_of: Callable[[str], RolloutState], routed: Routed, result: ApplyResult | None
) -> None:
    """Count an applied event; a freeze that froze its rollout incomplete counts as masked, by its reason kind.

    Only an accepted freeze reads the rollout's state, through ``state_of`` (the projection's memory, ahead of the
    files until its flush), so a freeze answered again or any other event costs one increment.
    """
    if result is None or not isinstance(routed, ApplyEvent):
        return
    _APPLIED[result.event_type].inc()
    if not isinstance(routed.event, FreezeEvent) or result.outcome is not ApplyOutcome.ACCEPTED:
        return
    state = state_of(routed.event.rollout_id)
    if not state.incomplete:
        return
    if state.dangling_intents:
        kind = "dangling_intent"
    elif any(mark.reason.startswith(_DEAD_LETTER_MARKS) for mark in state.incomplete_marks):
        kind = "dead_letter"
    else:
        kind = "marked_lost"
    ROLLOUTS_MASKED.labels(kind).inc()


def observe_freeze(read_at: float, now: float) -> None:
    """Observe one freeze answered ``now``, read at ``read_at`` (both ``time.monotonic``)."""
    FREEZE_SECONDS.observe(max(0.0, now - read_at))


def observe_command_wait(event_type: EventType, read_at: float, now: float) -> None:
    """Observe one source command answered ``now``, read at ``read_at`` (both ``time.monotonic``)."""
    _COMMAND_WAITS[event_type.value].observe(max(0.0, now - read_at))


def observe_command_read_delay(
    event_type: EventType, timestamp_ms: int | None, fetched_at_wall: float
) -> None:
    """Observe how long a source command waited in the log: from its log timestamp to its fetch (``time.time``).

    A message without a timestamp is not observed. A producer clock ahead of this host's counts as no wait.
    """
    if timestamp_ms is not None:
        _COMMAND_READ_DELAYS[event_type.value].observe(max(0.0, fetched_at_wall - timestamp_ms / 1000))


def observe_flush(kind: str, seconds: float) -> None:
    """Observe one flush of a block of ``kind`` (one of ``tokcap.metrics.BLOCK_KINDS``)."""
    _FLUSHES[kind].observe(seconds)

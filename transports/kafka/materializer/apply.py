"""The apply side of a routing decision: what a store does with it, and what its verdict says back.

The inbound router (``router``) only decides what a message is; the readers that keep a store (the
materializer, the timeline behind ``tokcap log`` and ``tokcap replay``) carry each decision out here, so they
write the same events at the same positions and read the same verdicts back.
"""

from __future__ import annotations

from typing import Protocol

from tokcap.files.store import ApplyOutcome, ApplyResult
from tokcap.log.events import Event, LedgerEvent, LedgerFailureEvent, LogPosition, StageEvent
from transports.kafka.wire.dead_letter_reason import REASON_LIMIT
from transports.kafka.wire.router import ApplyEvent, Buffered, Deferred, Routed

__all__ = ["Applier", "carry_out", "refused_staging_reason"]


class Applier(Protocol):
    """What carries a routed event out: a store, or the materializer's projection in front of one."""

    def apply(self, event: Event, position: LogPosition) -> ApplyResult: ...


def carry_out(store: Applier, topic: str, routed: Routed) -> ApplyResult | None:
    """Apply a routing decision to a store: the event, or the dead letter's mask; a buffered chunk is nothing yet.

    Return the store's verdict, ``None`` when nothing was applied.
    """
    if isinstance(routed, ApplyEvent):
        return store.apply(routed.event, routed.position(topic))
    if isinstance(routed, Deferred):
        raise TypeError("a deferred decision is settled by its router before it is carried out")
    if isinstance(routed, Buffered) or routed.mask is None:
        return None
    return store.apply(routed.mask, routed.position(topic))


def refused_staging_reason(routed: Routed, result: ApplyResult | None) -> str | None:
    """Why a staging event read from the log is a dead letter once applied, or ``None`` when it is not.

    Its writer was told ok when the broker acknowledged it, before anyone could see that the store refuses
    it: a different payload under a key already kept (the rules mask the rollout), or a rollout retired
    before it. Either way the event is lost to its writer, so it is dead-lettered like an undecodable one.
    """
    if not isinstance(routed, ApplyEvent) or result is None:
        return None
    if not isinstance(routed.event, StageEvent | LedgerEvent | LedgerFailureEvent):
        return None
    if result.outcome not in (ApplyOutcome.CONFLICT, ApplyOutcome.REJECTED_RETIRED):
        return None
    return f"refused {routed.event.type.value} event: {result.detail}"[:REASON_LIMIT]

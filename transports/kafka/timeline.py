"""Read a run topic message by message and replay it through the store's apply step, keeping each verdict.

The materializer remembers only recent verdicts; debugging needs the verdict of every event of a rollout,
however old. ``LogApplier`` takes messages in log order through the materializer's own inbound router
(``router``: chunk reassembly, abandoned chunk groups, the key check, dead-lettering, the incomplete mark of
a dead-lettered rollout), then applies each event with ``TokenCaptureStore.apply`` at its log position, so
every verdict is the one the real apply step takes.

Use it on a scratch directory for a rollout's timeline (``tokcap log``) or for a partial replay
(``tokcap replay --rollout`` or ``--until``). It writes no checkpoint and no dead-letter file: a full replay
that a materializer will continue belongs to ``Materializer`` itself.

Reading a single rollout, pass the other rollouts' messages to ``LogApplier.pass_over`` (``read_log``'s
``on_skipped``): a writer that starts a chunk group on another rollout abandons its open group on this one,
and the materializer sees that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition

from tokcap.errors import TransportError
from tokcap.files.store import ApplyOutcome, ApplyResult, TokenCaptureStore
from tokcap.log.events import (
    DropEvent,
    FreezeEvent,
    IncompleteEvent,
    LedgerEvent,
    LedgerFailureEvent,
    StageEvent,
)
from transports.kafka.client.admin import watermarks
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, open_reader
from transports.kafka.client.error_map import Request, read_failure, translated
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.client.offset_reader import OffsetReader
from transports.kafka.client.payload_reader import payload_restorer
from transports.kafka.materializer.apply import carry_out
from transports.kafka.wire.codec import HEADER_TYPE, HEADER_WRITER, LogMessage, headers_to_dict
from transports.kafka.wire.dead_letter_reason import REASON_LIMIT
from transports.kafka.wire.delta_parents import ParentRestorer
from transports.kafka.wire.router import (
    ApplyEvent,
    Buffered,
    DeadLetter,
    InboundRouter,
    Routed,
)
from transports.kafka.wire.topic_limits import LIMITS_PARTITION, LIMITS_RECORD_TYPE

__all__ = [
    "BUFFERED",
    "DEAD_LETTERED",
    "LIMITS_PASSED_OVER",
    "LIMITS_RECORDED",
    "LogApplier",
    "LogMessage",
    "TimelineEntry",
    "read_log",
]

DEAD_LETTERED = "dead-lettered"
"""The verdict of a message that could not be applied; its rollout, if the key names one, is marked incomplete."""

BUFFERED = "buffered"
"""The verdict of a chunk that waits for the rest of its event."""

LIMITS_RECORDED = "recorded"
"""The verdict of the topic's limits record: the limits every writer and reader uses."""

LIMITS_PASSED_OVER = "passed-over"
"""The verdict of a limits record anywhere but offset 0 of partition 0, which counts for nothing."""

_BATCH = 500
_POLL_S = 0.5


@dataclass(frozen=True)
class TimelineEntry:
    """What one message was and what the apply step decided for it."""

    partition: int
    offset: int
    timestamp_ms: int | None
    event_type: str
    model_call_id: str
    writer: str
    size: int
    decision: str
    detail: str = ""
    snapshot_id: str | None = None
    version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form for ``--json``."""
        return dict(self.__dict__)


def _messages_of(consumer: Consumer, timeout_s: float, context: ClientContext) -> list[Message]:
    """What the reader has fetched, waiting only for the first message.

    ``consume(n, timeout)`` returns early only once it has ``n`` messages, so a batch asked for at once waits
    out the whole timeout whenever fewer are left (every read of a small topic took half a second more so).
    """
    with translated(context, Request("read the log", timeout_s)):
        messages = list(consumer.consume(1, min(timeout_s, _POLL_S)))
        if messages:
            messages.extend(consumer.consume(_BATCH - 1, 0))
        return messages


def read_log(
    bootstrap_servers: str,
    topic: str,
    *,
    key: bytes | None = None,
    until: Mapping[int, int] | None = None,
    client_config: Mapping[str, Any] | None = None,
    timeout_s: float = 10.0,
    on_message: Callable[[int, int], None] | None = None,
    on_skipped: Callable[[LogMessage], object] | None = None,
) -> Iterator[LogMessage]:
    """Every message of the topic from the start up to the end (or ``until``), in order within each partition.

    ``until`` maps a partition to the first offset not to read; unnamed partitions are read to their end as
    it was when reading began. ``key`` keeps only the messages of that key (one rollout); the others are read
    and skipped; ``on_skipped(message)`` is called for each of those (see ``LogApplier.pass_over``).
    ``on_message(partition, offset)`` is called for every message read, kept or not.
    Raise ``TransportError`` when retention already removed the start of a partition: the run cannot be
    replayed whole.
    """
    marks = watermarks(bootstrap_servers, topic, client_config=client_config, timeout_s=timeout_s)
    ends: dict[int, int] = {}
    for partition, (low, high) in marks.items():
        end = high if until is None or partition not in until else min(high, until[partition])
        if low > 0:
            raise TransportError(
                f"partition {partition} of {topic!r} starts at offset {low}: retention removed the beginning of "
                "the run, so it cannot be replayed from the log"
            )
        if end > low:
            ends[partition] = end
    if until is not None:
        unknown = sorted(set(until) - set(marks))
        if unknown:
            raise TransportError(f"topic {topic!r} has no partition {unknown[0]} (it has {sorted(marks)})")
    if not ends:
        return
    context = ClientContext(bootstrap_servers, dict(client_config or {}))
    watch = AuthenticationWatch(context)
    consumer = open_reader(
        context, topic, dict.fromkeys(ends, 0), purpose="reader", watch=watch, timeout_s=timeout_s
    )
    try:
        pending = dict(ends)
        last_progress = time.monotonic()
        while pending:
            messages = _messages_of(consumer, timeout_s, context)
            watch.raise_if_failed()
            if messages:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > max(timeout_s, 30.0):
                raise TransportError(
                    f"reading {topic!r} stalled: partitions {sorted(pending)} gave no message for "
                    f"{max(timeout_s, 30.0):g} s before reaching offsets {pending}; check the broker"
                )
            for message in messages:
                error = message.error()
                if error is not None:
                    failure = read_failure(error, context, topic)
                    if failure is not None:
                        raise failure
                    continue
                partition, offset = int(message.partition() or 0), int(message.offset() or 0)
                stop_at = pending.get(partition)
                if stop_at is None or offset >= stop_at:
                    continue
                if on_message is not None:
                    on_message(partition, offset)
                if offset + 1 >= stop_at:
                    del pending[partition]
                    consumer.pause([TopicPartition(topic, partition)])
                if key is not None and message.key() != key:
                    if on_skipped is not None:
                        on_skipped(LogMessage.of(message))
                    continue
                yield LogMessage.of(message)
    finally:
        consumer.close()


def _drop_detail(event: DropEvent, result: ApplyResult) -> str:
    """Say what the drop asked for and why it did or did not retire the rollout."""
    asked = f"{event.snapshot_id} v{event.version}"
    if result.outcome is ApplyOutcome.ACCEPTED:
        return f"dropped {asked}"
    if result.dropped:
        return f"{asked} was already dropped"
    return f"kept: asked for {asked}, but the rollout is at {result.snapshot_id} v{result.version}"


@dataclass
class LogApplier:
    """Applies log messages, in order, to a store and returns the verdict of each one.

    Chunk groups that a message makes abandoned get entries of their own (at their first chunk's offset):
    ``take_all`` returns them with the message's entry, and ``abandoned`` keeps every one.
    """

    store: TokenCaptureStore
    topic: str
    router: InboundRouter = field(default_factory=InboundRouter)
    abandoned: list[TimelineEntry] = field(default_factory=list)
    reader: OffsetReader | None = None
    """Reads wire deltas' parents the router no longer keeps; closed by ``close``."""

    @classmethod
    def over_log(
        cls,
        store: TokenCaptureStore,
        topic: str,
        bootstrap_servers: str,
        *,
        client_config: Mapping[str, Any] | None = None,
        timeout_s: float = 10.0,
    ) -> LogApplier:
        """An applier by the topic's limits that reads a forgotten wire-delta parent again from the topic, and
        staged payloads from the staged-payload topic; ``close`` it after use."""
        context = ClientContext(bootstrap_servers, dict(client_config or {}))
        limits = read_topic_limits(context, topic, timeout_s=max(timeout_s, 30.0))
        reader = OffsetReader(context, topic, timeout_s=max(timeout_s, 30.0))
        payloads = payload_restorer(context, purpose="timeline-payloads", timeout_s=max(timeout_s, 30.0))
        router = InboundRouter(
            limits=limits, topic=topic, parents=ParentRestorer(reader.read), payloads=payloads
        )
        return cls(store, topic, router, reader=reader)

    def close(self) -> None:
        """Close the parent and payload readers, if any; idempotent."""
        self.router.payloads.close()
        if self.reader is not None:
            self.reader.close()

    def take(self, message: LogMessage) -> TimelineEntry:
        """Route, decode and apply one message; never raises for a bad message, it dead-letters it."""
        return next(entry for entry, own in self._take(message) if own)

    def take_all(self, message: LogMessage) -> list[TimelineEntry]:
        """The message's entry, with those of the chunk groups it makes abandoned, in the order decided."""
        return [entry for entry, _ in self._take(message)]

    def pass_over(self, message: LogMessage) -> list[TimelineEntry]:
        """A message of another rollout, read but not applied: the entries of the groups it makes abandoned."""
        return [self._carry_out(message, routed) for routed in self.router.pass_over(message)]

    def unfinished_groups(self) -> list[str]:
        """Chunk groups still waiting for chunks when the log ended."""
        return self.router.open_groups()

    def _take(self, message: LogMessage) -> list[tuple[TimelineEntry, bool]]:
        """Each decision's entry, and whether it is the message's own (the others are abandoned groups)."""
        taken = [
            (self._carry_out(message, routed), not _abandons(routed)) for routed in self.router.route(message)
        ]
        if not taken:
            # Only the topic's limits record routes to no decision: it is no event, and applies nothing.
            taken = [(self._limits_entry(message), True)]
        return taken

    def _limits_entry(self, message: LogMessage) -> TimelineEntry:
        recorded = message.partition == LIMITS_PARTITION and message.offset == 0
        return TimelineEntry(
            partition=message.partition,
            offset=message.offset,
            timestamp_ms=message.timestamp_ms,
            event_type=LIMITS_RECORD_TYPE,
            model_call_id="",
            writer=headers_to_dict(message.headers).get(HEADER_WRITER, ""),
            size=message.size,
            decision=LIMITS_RECORDED if recorded else LIMITS_PASSED_OVER,
            detail=self.router.limits.describe() if recorded else "not at offset 0 of partition 0: no effect",
        )

    def _carry_out(self, message: LogMessage, routed: Routed) -> TimelineEntry:
        result = carry_out(self.store, self.topic, routed)
        if isinstance(routed, ApplyEvent):
            assert result is not None
            return self._verdict(message, routed, result)
        own = not _abandons(routed)
        entry = TimelineEntry(
            partition=routed.partition,
            offset=routed.offset,
            timestamp_ms=message.timestamp_ms if own else None,
            event_type=routed.headers.get(HEADER_TYPE, "?"),
            model_call_id="",
            writer=routed.headers.get(HEADER_WRITER, ""),
            size=routed.size,
            decision=BUFFERED if isinstance(routed, Buffered) else DEAD_LETTERED,
            detail=routed.detail if isinstance(routed, Buffered) else routed.reason[:REASON_LIMIT],
        )
        if not own:
            self.abandoned.append(entry)
        return entry

    def _verdict(self, message: LogMessage, routed: ApplyEvent, result: ApplyResult) -> TimelineEntry:
        """What the apply step decided for an event, with the detail a reader of the timeline needs."""
        event = routed.event
        detail = result.detail
        if isinstance(event, FreezeEvent) and result.outcome is ApplyOutcome.ACCEPTED:
            detail = self._freeze_detail(event.rollout_id)
        elif isinstance(event, DropEvent):
            detail = _drop_detail(event, result)
        elif isinstance(event, IncompleteEvent):
            reason = f"reason: {event.reason or '(none given)'}"
            detail = f"{reason}; {detail}" if detail else reason
        elif isinstance(event, StageEvent | LedgerEvent | LedgerFailureEvent):
            what = _staging_detail(event)
            detail = f"{what}; {detail}" if detail else what
        return TimelineEntry(
            partition=routed.partition,
            offset=routed.offset,
            timestamp_ms=message.timestamp_ms,
            event_type=routed.headers.get(HEADER_TYPE, "?"),
            model_call_id=result.model_call_id or getattr(event, "model_call_id", ""),
            writer=routed.headers.get(HEADER_WRITER, ""),
            size=routed.size,
            decision=result.outcome.value,
            detail=detail,
            snapshot_id=result.snapshot_id,
            version=result.version,
        )

    def _freeze_detail(self, rollout_id: str) -> str:
        """Why a freeze made the snapshot incomplete: dangling intents, or earlier incomplete marks."""
        state = self.store.read_state(rollout_id)
        if state.dangling_intents:
            return f"incomplete: no entry for dispatched call(s) {', '.join(state.dangling_intents)}"
        if state.incomplete:
            return "incomplete: a call was marked lost before the freeze"
        return ""


def _staging_detail(event: StageEvent | LedgerEvent | LedgerFailureEvent) -> str:
    """What a staged call or ledger row holds, in a line: its key and the sizes of its blobs, or its failure."""
    if isinstance(event, StageEvent):
        tokens = len(event.row.get("token_ids_delta") or [])
        extras = "no extras" if event.extras is None else f"extras {event.extras.size} B"
        attached = ", ".join(f"{name} {blob.size} B" for name, blob in sorted(event.attachments.items()))
        return f"staged {event.staging_key}: {tokens} tokens, {extras}, attachments: {attached or 'none'}"
    if isinstance(event, LedgerEvent):
        return f"ledger row for {event.row.get('staging_key')}, cum_len {event.row.get('cum_len')}"
    return f"ledger failure: {event.reason}"


def _abandons(routed: Routed) -> bool:
    """Whether a decision is an abandoned chunk group rather than the message itself."""
    return isinstance(routed, DeadLetter) and routed.abandoned

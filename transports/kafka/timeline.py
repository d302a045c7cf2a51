"""Read a run topic message by message and replay it through the store's apply step, keeping each verdict.

The materializer remembers only recent verdicts; debugging needs the verdict of every event of a rollout,
however old. ``LogApplier`` takes messages in log order and routes them as the materializer does
(chunk reassembly, dead-lettering, the incomplete mark of a dead-lettered rollout), then applies each event
with ``TokenCaptureStore.apply`` at its log position, so every verdict is the one the real apply step takes.

Use it on a scratch directory for a rollout's timeline (``tokcap log``) or for a partial replay
(``tokcap replay --rollout`` or ``--until``). It writes no checkpoint and no dead-letter file: a full replay
that a materializer will continue belongs to ``Materializer`` itself.

One difference is inherent to reading a single rollout: the materializer abandons an open chunk group when
the same writer starts another group on another rollout; filtered to one rollout, that cannot be seen, and
the group is reported as never completed instead.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from tokcap.errors import EventDecodeError, NewerSchemaError, TransportError
from tokcap.events import DropEvent, Event, FreezeEvent, IncompleteEvent, LogPosition
from tokcap.store import ApplyOutcome, ApplyResult, TokenCaptureStore
from transports.kafka.admin import watermarks
from transports.kafka.client_errors import (
    AuthenticationWatch,
    ClientContext,
    build_client,
    read_error,
    request_error,
    scrubbed_cause,
)
from transports.kafka.codec import (
    HEADER_TYPE,
    HEADER_WRITER,
    ChunkHeader,
    decode_event_value,
    headers_to_dict,
    read_chunk_header,
    rollout_of_key,
)
from transports.kafka.materializer import MATERIALIZER_WRITER

__all__ = [
    "BUFFERED",
    "DEAD_LETTERED",
    "LogApplier",
    "LogMessage",
    "TimelineEntry",
    "read_log",
]

DEAD_LETTERED = "dead-lettered"
"""The verdict of a message that could not be applied; its rollout, if the key names one, is marked incomplete."""

BUFFERED = "buffered"
"""The verdict of a chunk that waits for the rest of its event."""

_REASON_LIMIT = 600
_BATCH = 500
_POLL_S = 0.5


@dataclass(frozen=True)
class LogMessage:
    """One message as read from the log."""

    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    value: bytes | None

    @property
    def size(self) -> int:
        """Bytes of key and value, what the message costs on the broker before compression."""
        return len(self.key or b"") + len(self.value or b"")


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
    try:
        return list(consumer.consume(_BATCH, min(timeout_s, _POLL_S)))
    except KafkaException as exc:
        raise request_error(
            exc, doing="read the log", context=context, timeout_s=timeout_s
        ) from scrubbed_cause(exc, context)


def read_log(
    bootstrap_servers: str,
    topic: str,
    *,
    key: bytes | None = None,
    until: Mapping[int, int] | None = None,
    client_config: Mapping[str, Any] | None = None,
    timeout_s: float = 10.0,
    on_message: Callable[[int, int], None] | None = None,
) -> Iterator[LogMessage]:
    """Every message of the topic from the start up to the end (or ``until``), in order within each partition.

    ``until`` maps a partition to the first offset not to read; unnamed partitions are read to their end as
    it was when reading began. ``key`` keeps only the messages of that key (one rollout); the others are read
    and skipped. ``on_message(partition, offset)`` is called for every message read, kept or not.
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
    settings = context.settings(
        {
            "group.id": f"tokcap-reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "error",
            "error_cb": watch,
        }
    )
    consumer = build_client(Consumer, settings, context, "consumer")
    try:
        consumer.assign([TopicPartition(topic, partition, 0) for partition in sorted(ends)])
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
                    failure = read_error(error, topic=topic, context=context)
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
                    continue
                kind, stamp = message.timestamp()
                yield LogMessage(
                    partition=partition,
                    offset=offset,
                    timestamp_ms=int(stamp) if kind != 0 else None,
                    key=message.key(),
                    headers=_header_pairs(message.headers()),
                    value=message.value(),
                )
    finally:
        consumer.close()


def _header_pairs(
    headers: Mapping[str, str | bytes | None] | list[tuple[str, str | bytes | None]] | None,
) -> tuple[tuple[str, bytes | None], ...]:
    """Headers as ``(name, bytes)`` pairs in their order on the message."""
    pairs = headers.items() if isinstance(headers, Mapping) else (headers or [])
    return tuple((name, value.encode() if isinstance(value, str) else value) for name, value in pairs)


@dataclass
class _OpenGroup:
    header: ChunkHeader
    key: bytes
    headers: dict[str, str]
    offsets: list[int]
    pieces: list[bytes]
    size: int


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
    """Applies log messages, in order, to a store and returns the verdict of each one."""

    store: TokenCaptureStore
    topic: str
    groups: dict[tuple[int, str], _OpenGroup] = field(default_factory=dict)

    def take(self, message: LogMessage) -> TimelineEntry:
        """Route, decode and apply one message; never raises for a bad message, it dead-letters it."""
        try:
            headers = headers_to_dict(message.headers)
            chunk = read_chunk_header(headers)
        except EventDecodeError as exc:
            return self._dead_letter(message, {}, f"undecodable headers: {exc}", message.size)
        if chunk is None:
            return self._decode_and_apply(message, message.key, message.value, headers, message.size)
        return self._take_chunk(message, headers, chunk)

    def unfinished_groups(self) -> list[str]:
        """Chunk groups still waiting for chunks when the log ended."""
        return sorted(group for _, group in self.groups)

    def _entry(
        self, message: LogMessage, headers: Mapping[str, str], size: int, decision: str, **extra: Any
    ) -> TimelineEntry:
        return TimelineEntry(
            partition=message.partition,
            offset=message.offset,
            timestamp_ms=message.timestamp_ms,
            event_type=headers.get(HEADER_TYPE, "?"),
            model_call_id=extra.pop("model_call_id", ""),
            writer=headers.get(HEADER_WRITER, ""),
            size=size,
            decision=decision,
            **extra,
        )

    def _apply(self, event: Event, partition: int, offset: int) -> ApplyResult:
        return self.store.apply(event, LogPosition(self.topic, partition, offset))

    def _dead_letter(
        self, message: LogMessage, headers: Mapping[str, str], reason: str, size: int
    ) -> TimelineEntry:
        """Mask the rollout the key names, at this message's position, as the materializer does."""
        rollout_id = rollout_of_key(message.key)
        if rollout_id is not None:
            mark = IncompleteEvent(
                rollout_id=rollout_id,
                writer=MATERIALIZER_WRITER,
                reason=f"dead-lettered event at partition {message.partition} offset {message.offset}: {reason}"[
                    :_REASON_LIMIT
                ],
            )
            self._apply(mark, message.partition, message.offset)
        return self._entry(message, headers, size, DEAD_LETTERED, detail=reason[:_REASON_LIMIT])

    def _decode_and_apply(
        self,
        message: LogMessage,
        key: bytes | None,
        value: bytes | None,
        headers: Mapping[str, str],
        size: int,
    ) -> TimelineEntry:
        if value is None:
            return self._dead_letter(message, headers, "message has no value", size)
        try:
            event = decode_event_value(value, headers)
        except NewerSchemaError as exc:
            return self._dead_letter(message, headers, f"newer schema: {exc}", size)
        except EventDecodeError as exc:
            return self._dead_letter(message, headers, f"undecodable event: {exc}", size)
        if key is None or key != event.rollout_id.encode():
            return self._dead_letter(
                message, headers, f"key {key!r} does not match the event's rollout {event.rollout_id!r}", size
            )
        if rollout_of_key(key) is None:
            reason = f"invalid rollout id {event.rollout_id!r}"
            return self._entry(message, headers, size, DEAD_LETTERED, detail=reason)
        result = self._apply(event, message.partition, message.offset)
        detail = result.detail
        if isinstance(event, FreezeEvent) and result.outcome is ApplyOutcome.ACCEPTED:
            detail = self._freeze_detail(event.rollout_id)
        elif isinstance(event, DropEvent):
            detail = _drop_detail(event, result)
        elif isinstance(event, IncompleteEvent):
            reason = f"reason: {event.reason or '(none given)'}"
            detail = f"{reason}; {detail}" if detail else reason
        return self._entry(
            message,
            headers,
            size,
            result.outcome.value,
            model_call_id=result.model_call_id or getattr(event, "model_call_id", ""),
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

    def _take_chunk(self, message: LogMessage, headers: dict[str, str], chunk: ChunkHeader) -> TimelineEntry:
        key = message.key or b""
        value = message.value or b""
        slot = (message.partition, chunk.group)
        if chunk.index == 0:
            if slot in self.groups:
                return self._dead_letter(
                    message, headers, f"duplicate first chunk of group {chunk.group}", message.size
                )
            self.groups[slot] = _OpenGroup(chunk, key, headers, [message.offset], [value], message.size)
            return self._entry(
                message, headers, message.size, BUFFERED, detail=f"chunk 1/{chunk.count} of {chunk.group}"
            )
        group = self.groups.get(slot)
        if group is None:
            return self._dead_letter(
                message,
                headers,
                f"orphaned chunk {chunk.index}/{chunk.count} of group {chunk.group}",
                message.size,
            )
        expected = (len(group.pieces), group.header.count, group.header.digest, group.key)
        if (chunk.index, chunk.count, chunk.digest, key) != expected:
            del self.groups[slot]
            return self._dead_letter(
                message,
                headers,
                f"chunk {chunk.index}/{chunk.count} does not continue group {chunk.group}",
                message.size,
            )
        group.offsets.append(message.offset)
        group.pieces.append(value)
        group.size += message.size
        if len(group.pieces) < group.header.count:
            return self._entry(
                message,
                headers,
                message.size,
                BUFFERED,
                detail=f"chunk {chunk.index + 1}/{chunk.count} of {chunk.group}",
            )
        del self.groups[slot]
        whole = b"".join(group.pieces)
        if hashlib.sha256(whole).hexdigest() != group.header.digest:
            return self._dead_letter(
                message, headers, f"chunk group {chunk.group} reassembles to a different digest", group.size
            )
        return self._decode_and_apply(message, group.key, whole, group.headers, group.size)

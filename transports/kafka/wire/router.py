"""The inbound router: what each message read from a run topic becomes, in log order.

Both readers of a topic route through here, the materializer and the timeline behind ``tokcap log`` and
``tokcap replay``, so they cannot disagree about a message. A message becomes one of:

- ``ApplyEvent``: a whole event, or the last chunk of a complete chunk group, to apply at its log position;
- ``Buffered``: a chunk that waits for the rest of its group;
- ``Deferred``: a whole capture message (intent, cancel, put, incomplete) of a valid rollout key, routed by its
  headers and key alone when the router defers decoding; ``settle`` decodes it later into one of the others;
- ``DeadLetter``: a message that cannot be applied (undecodable headers or value, unknown type, newer schema,
  an event the sinks' input rules refuse, a key that does not name the event's rollout, a chunk that
  continues no group, a group whose bytes do not match their digest), or a chunk group that can never
  complete. Where the key names a valid rollout, the
  dead letter carries the incomplete mark that masks it.

A chunk group can never complete, and is abandoned, when the same writer session starts another group (its
chunks of one group are contiguous in its output), when a chunk does not continue it, when its rollout is
frozen first, or when it is still open ``ORPHAN_AFTER_OFFSETS`` offsets after its first chunk. A freeze
abandons its rollout's open groups before it applies: whatever completes after the cut is never part of
the snapshot, so a snapshot taken while a group is open must be masked, not returned complete. The router
only decides: the readers that keep a store carry its decisions out (``apply``), and only the materializer
writes dead-letter lines.

Every decision has a log position: the offset of the message whose routing took it, and its ``index`` among the
decisions about the same rollout routing that message took, in their order. An abandoned group's mask thus sits
before the freeze that abandoned it, and a resumed reader that decides again finds it applied, as any event.
The index counts per rollout, so a reader of some rollouts, which passes over the others' messages, gives each
of its decisions the position the materializer gives it.

Memory is bounded, by the topic's limits (``topic_limits``), which every writer and reader of a topic share.
A group larger than ``max_event_bytes``
is dead-lettered and its rollout masked as soon as its first chunk declares it (``count - 1`` chunks of the
first chunk's length and at least one byte more) or its chunks so far exceed it; nothing more of it is
buffered, and its later chunks are orphans. The open groups of one partition hold at most
``max_open_chunk_bytes`` value bytes; a chunk that would take them past it first abandons the partition's
oldest open groups (``_make_room`` says why). Both limits are per partition, not per router, because every
reader must take the same decision from the same log: the materializer, a resumed materializer, one that
owns a subset of the partitions, and ``tokcap log``/``replay`` read partitions interleaved differently, but
each partition in the same order. A router reading ``P`` partitions thus holds at most
``P * max_open_chunk_bytes`` bytes of chunks. A whole message is not checked: the broker's message limit
already bounds it, and it is in memory once fetched.

Deferred decoding (the materializer's router): decoding and validating a put costs far more than reading its
headers, and a freeze waits for every message before it to be routed. A deferred message is decoded when its
own rollout needs it (that rollout's freeze is answered or its events are applied), or when the reader has
time to spare (``settle_oldest``). A rollout's messages are always decoded in their log order, whichever path
asks first, so wire deltas meet the same parents and every deferred message settles to the decision routing
it at once would have given. Commands, chunks, messages without a type header and keys that name no rollout
are never deferred.

The topic's limits record (offset 0 of partition 0) is no decision: routing it gives none. A reader that
started before the record was written and used other limits stops there (``check_recorded``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from tokcap.errors import EventDecodeError, NewerSchemaError
from tokcap.log.events import (
    LOG_READER_WRITER,
    DeleteEvent,
    Event,
    FreezeEvent,
    IncompleteEvent,
    LogPosition,
    PutEvent,
    RetireEvent,
)
from tokcap.log.hashing import sha256_hex
from tokcap.log.records import token_count
from transports.kafka.wire.codec import (
    HEADER_TYPE,
    ChunkHeader,
    LogMessage,
    decode_message,
    decode_wire_delta,
    headers_to_dict,
    is_wire_delta,
    read_chunk_header,
    rollout_of_key,
)
from transports.kafka.wire.dead_letter_reason import REASON_LIMIT
from transports.kafka.wire.delta_parents import ParentRestorer
from transports.kafka.wire.staged_payloads import StagedPayloadRestorer, is_staged_reference
from transports.kafka.wire.topic_limits import (
    LIMITS_PARTITION,
    TOPIC_DEFAULTS,
    TopicLimits,
    check_recorded,
    decode_limits_record,
    is_limits_record,
)

__all__ = [
    "MATERIALIZER_WRITER",
    "ORPHAN_AFTER_OFFSETS",
    "ApplyEvent",
    "Buffered",
    "DeadLetter",
    "Deferred",
    "InboundRouter",
    "Routed",
    "logger",
    "rollout_of",
]

logger = logging.getLogger(__name__)

MATERIALIZER_WRITER = LOG_READER_WRITER
"""Writer id of the incomplete markers the materializer itself applies."""

ORPHAN_AFTER_OFFSETS = 100_000
"""A chunk group still open this many offsets after its first chunk will never complete."""

_DEFERRABLE_TYPES = frozenset({"intent", "cancel", "put", "incomplete"})
"""Type headers of the messages whose decoding may wait: a rollout's capture, never a command a source waits on."""


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

_Decided = TypeVar("_Decided", Routed, Routed | Deferred)
"""The decisions of one message, as routing or passing over it returns them."""


@dataclass
class _OpenGroup:
    """The chunks of one large event received so far.

    A ghost is another rollout's group seen by ``pass_over``: its bytes are counted but not kept, so a reader
    of one rollout takes the budget decisions a reader of them all takes.
    """

    header: ChunkHeader
    key: bytes
    headers: dict[str, str]
    offsets: list[int]
    pieces: list[bytes]
    size: int
    held: int
    """Value bytes of the chunks received, what the reassembled value holds so far."""
    ghost: bool = False


@dataclass
class InboundRouter:
    """Routes messages partition by partition, holding the chunk groups still open in each.

    ``limits`` bound the memory chunks take (module docstring); every reader of a topic must use the topic's
    own (``limits_record``), or they may decide differently about a large group.
    """

    orphan_after_offsets: int = ORPHAN_AFTER_OFFSETS
    limits: TopicLimits = TOPIC_DEFAULTS
    """The topic's limits: the largest reassembled value and the open groups' budget per partition."""
    topic: str = ""
    """The topic read, for messages."""
    parents: ParentRestorer = field(default_factory=ParentRestorer)
    """Restores wire deltas; give it a way to read the log (``OffsetReader``) where parents may be forgotten."""
    payloads: StagedPayloadRestorer = field(default_factory=StagedPayloadRestorer)
    """Restores staged references; give it a way to read the staged-payload topic (``staged_payloads``)."""
    _groups: dict[int, dict[str, _OpenGroup]] = field(default_factory=dict)
    _held: dict[int, int] = field(default_factory=dict)
    """Per partition, the value bytes its open groups hold (ghosts' counted too)."""
    _deferred: dict[bytes, deque[Deferred]] = field(default_factory=dict)
    """Per key, its deferred messages not settled yet, in log order."""
    _arrived: deque[Deferred] = field(default_factory=deque)
    """Every deferred message in the order it was routed; those settled meanwhile are skipped."""
    decoded_ahead_tokens: int = 0
    """Tokens of the puts ``settle_oldest`` decoded that nobody has asked for yet: memory a reader that
    decodes ahead holds on top of the messages' bytes, which it may bound."""

    # ------------------------------------------------------------ what is open

    def open_chunk_offsets(self, partition: int) -> list[int]:
        """The offsets of every chunk of the partition's open groups: a resume must read them again."""
        return sorted(o for group in self._groups.get(partition, {}).values() for o in group.offsets)

    def open_groups(self) -> list[str]:
        """Chunk groups still waiting for chunks, in every partition (another rollout's seen by ``pass_over``
        excluded)."""
        return sorted(
            name for groups in self._groups.values() for name, group in groups.items() if not group.ghost
        )

    def open_chunk_bytes(self, partition: int) -> int:
        """Value bytes the partition's open groups hold (``max_open_chunk_bytes`` bounds it)."""
        return self._held.get(partition, 0)

    def unsettled(self) -> int:
        """Deferred messages not decoded yet, over every rollout."""
        return sum(len(waiting) for waiting in self._deferred.values())

    # ------------------------------------------------------------- settling

    def settle(self, deferred: Deferred) -> ApplyEvent | DeadLetter:
        """The decision a deferred message stands for, decoding its rollout's earlier deferred ones first."""
        if deferred.decided is None:
            key = (deferred.message.key if deferred.message is not None else None) or b""
            self._settle_key(key, until=deferred)
        assert deferred.decided is not None, "a deferred message was settled out of its rollout's order"
        if deferred.decoded_ahead:
            deferred.decoded_ahead = False
            self.decoded_ahead_tokens -= _tokens_of(deferred.decided)
        return deferred.decided

    def settle_oldest(self, deadline: float, max_tokens: int | None = None) -> int:
        """Decode deferred messages oldest first until ``deadline`` (``time.monotonic``) passes; return how many.

        With ``max_tokens``, decoding also stops once ``decoded_ahead_tokens`` reaches it.

        A reader with time to spare calls this, so the decoding a freeze would otherwise pay for its rollout
        is mostly done before the freeze arrives, while reading itself never waits for it.
        Messages settled meanwhile by their rollout are let go of whatever the deadline, so a reader that
        applied everything keeps no reference to what it applied.
        """
        settled = 0
        while self._arrived:
            oldest = self._arrived[0]
            if oldest.decided is None:
                if time.monotonic() >= deadline or (
                    max_tokens is not None and self.decoded_ahead_tokens >= max_tokens
                ):
                    break
                # Its rollout's earlier messages arrived earlier and are settled already: one decode.
                decided = self.settle(oldest)
                oldest.decoded_ahead = True
                self.decoded_ahead_tokens += _tokens_of(decided)
                settled += 1
            self._arrived.popleft()
        return settled

    def all_decoded(self) -> bool:
        """Whether every deferred message routed so far is decoded (``settle_oldest`` has nothing left)."""
        while self._arrived and self._arrived[0].decided is not None:
            self._arrived.popleft()
        return not self._arrived

    def _settle_key(self, key: bytes, until: Deferred | None = None) -> None:
        """Decode the key's deferred messages in log order, all of them or up to and including ``until``."""
        waiting = self._deferred.get(key)
        while waiting:
            head = waiting.popleft()
            message = head.message
            assert message is not None
            head.decided = self._decode(
                message, message.key, message.value, head.headers, head.size, whole=True, settle_first=False
            )
            head.message = None
            if head is until:
                break
        if waiting is not None and not waiting:
            del self._deferred[key]

    # ---------------------------------------------------------------- routing

    def route(self, message: LogMessage) -> list[Routed]:
        """What the message becomes, preceded and followed by the groups it makes abandoned."""
        return [
            self.settle(decision) if isinstance(decision, Deferred) else decision
            for decision in self._route(message, defer=False)
        ]

    def route_deferring(self, message: LogMessage) -> list[Routed | Deferred]:
        """As ``route``, but a capture message may come back ``Deferred``: settle it before using it."""
        return self._route(message, defer=True)

    def _route(self, message: LogMessage, *, defer: bool) -> list[Routed | Deferred]:
        routed: list[Routed | Deferred]
        try:
            headers = headers_to_dict(message.headers)
            chunk = read_chunk_header(headers)
        except EventDecodeError as exc:
            routed = [self._dead_letter(message, {}, message.size, f"undecodable headers: {exc}")]
        else:
            if chunk is None and is_limits_record(headers):
                self._check_limits_record(message, headers)
                routed = []
            elif chunk is None:
                routed = [self._whole(message, headers, defer=defer)]
            else:
                routed = [*self._take_chunk(message, headers, chunk)]
        return _indexed([*self._abandon_before_freeze(message, routed), *self._abandon_stale(message)])

    def _check_limits_record(self, message: LogMessage, headers: Mapping[str, str]) -> None:
        """The record at offset 0 of partition 0 must hold the limits this router uses; any other is passed over."""
        if message.partition == LIMITS_PARTITION and message.offset == 0:
            check_recorded(self.topic, decode_limits_record(message.value, headers), self.limits)

    def pass_over(self, message: LogMessage) -> list[Routed]:
        """A message read but not routed (another rollout's): it can still make open groups abandoned.

        A reader of one rollout calls this for the others' messages, so it abandons exactly the groups
        the materializer, which reads them all, abandons. A reader that needs only some events (the lineage
        resolver, puts) passes over the chunks of the others the same way: counted, never kept or decoded.
        """
        routed: list[Routed] = []
        try:
            headers = headers_to_dict(message.headers)
            chunk = read_chunk_header(headers)
        except EventDecodeError:
            chunk = None
        if chunk is not None:
            # Its group is kept as a ghost (sizes, no bytes); only the groups this reader routes are reported.
            routed = [
                decided
                for decided in self._take_chunk(message, headers, chunk, ghost=True)
                if isinstance(decided, DeadLetter) and decided.abandoned
            ]
        elif headers.get(HEADER_TYPE) == "freeze":
            self._close_frozen_ghosts(message, headers)
        elif is_limits_record(headers):
            self._check_limits_record(message, headers)
        return _indexed(routed + self._abandon_stale(message))

    def _close_frozen_ghosts(self, message: LogMessage, headers: Mapping[str, str]) -> None:
        """A freeze passed over closes its rollout's ghost groups, as routing it closes the groups it abandons."""
        try:
            event = decode_message(message.key, message.value, headers)
        except (EventDecodeError, NewerSchemaError):
            return
        if isinstance(event, FreezeEvent):
            for group in list(self._groups.get(message.partition, {}).values()):
                if group.ghost and rollout_of_key(group.key) == event.rollout_id:
                    self._close(message.partition, group)

    def rebuffer(self, message: LogMessage) -> None:
        """Take back a chunk of a group that was open at the checkpoint; it was checked when first read."""
        headers = headers_to_dict(message.headers)
        header = read_chunk_header(headers)
        if header is None:
            raise EventDecodeError(
                f"checkpointed chunk offset {message.offset} of partition {message.partition} is not a chunk; "
                "the checkpoint does not belong to this topic: replay into a new directory"
            )
        value = message.value or b""
        group = self._groups.get(message.partition, {}).get(header.group)
        if group is None:
            self._open(
                message.partition,
                _OpenGroup(header, message.key or b"", headers, [], [], 0, 0),
            )
            group = self._groups[message.partition][header.group]
        self._add(message.partition, group, message.offset, value, message.size)

    # ------------------------------------------------------------ the rules

    def _whole(self, message: LogMessage, headers: dict[str, str], *, defer: bool) -> Routed | Deferred:
        """A message that is not a chunk: deferred when asked and allowed, else decoded now."""
        if defer and headers.get(HEADER_TYPE) in _DEFERRABLE_TYPES and message.key:
            rollout_id = rollout_of_key(message.key)
            if rollout_id is not None:
                deferred = Deferred(
                    message.partition, message.offset, headers, message.size, rollout_id, message
                )
                self._deferred.setdefault(message.key, deque()).append(deferred)
                self._arrived.append(deferred)
                return deferred
        return self._decode(message, message.key, message.value, headers, message.size, whole=True)

    def _decode(
        self,
        message: LogMessage,
        key: bytes | None,
        value: bytes | None,
        headers: Mapping[str, str],
        size: int,
        *,
        whole: bool = False,
        settle_first: bool = True,
    ) -> ApplyEvent | DeadLetter:
        """Decode a whole message (``whole``) or a reassembled chunk group; a wire delta is restored.

        The key's deferred messages are decoded first (unless the caller is settling them, in order), so a
        rollout's messages always meet the parent restorer in log order. A whole put is kept as a possible
        parent. An event whose type is not the one its header names is refused: a reader that routes by the
        header must not be misled by it.
        """
        if settle_first and key is not None and key in self._deferred:
            self._settle_key(key)
        try:
            if is_wire_delta(headers):
                delta = decode_wire_delta(key, value, headers)
                event: Event = self.parents.restore(
                    key or b"", message.partition, message.offset, delta, keep=whole
                )
                _check_named_type(headers, event)
            elif is_staged_reference(headers):
                event = self.payloads.restore(key, value, headers, self.limits)
                _check_named_type(headers, event)
            else:
                event = decode_message(key, value, headers)
                _check_named_type(headers, event)
                if whole and isinstance(event, PutEvent):
                    self.parents.remember(key or b"", message.partition, message.offset, event)
        except (EventDecodeError, NewerSchemaError) as exc:
            return self._dead_letter(message, headers, size, str(exc))
        if isinstance(event, RetireEvent | DeleteEvent):
            self.parents.forget(key or b"")
        return ApplyEvent(event, message.partition, message.offset, headers, size)

    def _take_chunk(
        self, message: LogMessage, headers: dict[str, str], chunk: ChunkHeader, *, ghost: bool = False
    ) -> list[Routed]:
        """Add a chunk to its group; a completed group becomes its event (a ghost's, nothing)."""
        key = message.key or b""
        value = message.value or b""
        size = message.size
        partition = message.partition
        if chunk.index == 0:
            # The same session's older group, the same group id included, can no longer complete.
            abandoned = self._abandon_session(message, chunk)
            declared = (chunk.count - 1) * len(value) + 1
            if declared > self.limits.max_event_bytes:
                why = (
                    f"chunk group {chunk.group} declares at least {declared:,} bytes ({chunk.count} chunks of "
                    f"{len(value):,}), over the maximum event size of {self.limits.max_event_bytes:,} bytes "
                    "(max_event_bytes); none of it is buffered"
                )
                return [*abandoned, self._too_large(message, headers, size, why, ghost)]
            evicted = self._make_room(message, len(value), None)
            opened = _OpenGroup(chunk, key, headers, [], [], 0, 0, ghost)
            self._open(partition, opened)
            self._add(partition, opened, message.offset, value, size)
            return [
                *abandoned,
                *evicted,
                Buffered(partition, message.offset, headers, size, self._progress(chunk)),
            ]
        group = self._groups.get(partition, {}).get(chunk.group)
        if group is None:
            why = f"orphaned chunk {chunk.index}/{chunk.count} of group {chunk.group}"
            return [self._dead_letter(message, headers, size, why)]
        expected = (len(group.pieces), group.header.count, group.header.digest, group.key)
        if (chunk.index, chunk.count, chunk.digest, key) != expected:
            return [
                *self._abandon(
                    message, group, f"chunk {chunk.index} at offset {message.offset} does not continue it"
                ),
                self._dead_letter(
                    message,
                    headers,
                    size,
                    f"chunk {chunk.index}/{chunk.count} does not continue group {chunk.group}",
                ),
            ]
        received = group.held + len(value)
        if received > self.limits.max_event_bytes:
            why = (
                f"its chunks reach {received:,} bytes at chunk {chunk.index} (offset {message.offset}), over the "
                f"maximum event size of {self.limits.max_event_bytes:,} bytes (max_event_bytes)"
            )
            too_large = self._abandon(message, group, why)
            self._log_abandoned(too_large)
            return [
                *too_large,
                self._dead_letter(
                    message, headers, size, f"chunk {chunk.index}/{chunk.count} of group {chunk.group}: {why}"
                ),
            ]
        evicted = []
        if self._held[partition] + len(value) > self.limits.max_open_chunk_bytes:
            evicted = self._make_room(message, len(value), group)
        self._add(partition, group, message.offset, value, size)
        if len(group.pieces) < group.header.count:
            buffered = Buffered(partition, message.offset, headers, size, self._progress(chunk))
            return [*evicted, buffered] if evicted else [buffered]
        self._close(partition, group)
        if group.ghost:
            return evicted
        whole = b"".join(group.pieces)
        if sha256_hex(whole) != group.header.digest:
            why = f"chunk group {chunk.group} reassembles to a different digest"
            return [*evicted, self._dead_letter(message, headers, group.size, why)]
        return [*evicted, self._decode(message, group.key, whole, group.headers, group.size)]

    def _open(self, partition: int, group: _OpenGroup) -> None:
        self._groups.setdefault(partition, {})[group.header.group] = group
        self._held[partition] = self._held.get(partition, 0) + group.held

    def _add(self, partition: int, group: _OpenGroup, offset: int, value: bytes, size: int) -> None:
        """Append a chunk to an open group; a ghost keeps its length only."""
        group.offsets.append(offset)
        group.pieces.append(b"" if group.ghost else value)
        group.size += size
        group.held += len(value)
        self._held[partition] += len(value)

    def _close(self, partition: int, group: _OpenGroup) -> None:
        groups = self._groups.get(partition, {})
        if groups.get(group.header.group) is group:
            del groups[group.header.group]
            self._held[partition] -= group.held

    def _make_room(self, message: LogMessage, incoming: int, keep: _OpenGroup | None) -> list[Routed]:
        """Abandon the partition's oldest open groups (not ``keep``) until ``incoming`` more bytes fit the budget.

        Never a silent drop: each abandoned group is a dead letter whose reason says to raise the budget, and
        its rollout is masked, so it is never trained on partial data. The oldest go first because a group
        that has stayed open while newer ones began is the one most likely never to complete (its writer
        died between chunks), whereas the group receiving a chunk has a live writer; refusing the newcomer
        instead would let one stuck group mask every later large event until it goes stale. ``keep`` fits
        alone once the others are gone: it is at most ``max_event_bytes``, and the budget is at least that.
        """
        partition = message.partition
        held = self._held.get(partition, 0)
        if held + incoming <= self.limits.max_open_chunk_bytes:
            return []
        why = (
            f"the open chunk groups of partition {partition} would hold {held + incoming:,} bytes, over the "
            f"budget of {self.limits.max_open_chunk_bytes:,} bytes (max_open_chunk_bytes); the oldest open group is "
            "abandoned first. If writers send many large events at once, run on a topic made with a larger "
            "max_open_chunk_bytes (`tokcap topic create --max-open-chunk-bytes N`)"
        )
        evicted: list[Routed] = []
        for group in sorted(
            self._groups.get(partition, {}).values(), key=lambda open_group: open_group.offsets[0]
        ):
            if self._held[partition] + incoming <= self.limits.max_open_chunk_bytes:
                break
            if group is not keep:
                evicted.extend(self._abandon(message, group, why))
        self._log_abandoned(evicted)
        return evicted

    def _too_large(
        self, message: LogMessage, headers: Mapping[str, str], size: int, why: str, ghost: bool
    ) -> DeadLetter:
        decided = self._dead_letter(message, headers, size, why)
        if not ghost:
            self._log_abandoned([decided])
        return decided

    @staticmethod
    def _log_abandoned(decided: Sequence[Routed]) -> None:
        """Log the groups the memory limits abandoned: an operator may have to raise a limit."""
        for item in decided:
            if isinstance(item, DeadLetter):
                logger.warning(
                    "chunk group dead-lettered at partition %d offset %d (rollout %s masked): %s",
                    item.partition,
                    item.offset,
                    item.rollout_id,
                    item.reason,
                )

    @staticmethod
    def _progress(chunk: ChunkHeader) -> str:
        return f"chunk {chunk.index + 1}/{chunk.count} of {chunk.group}"

    def _abandon_session(self, message: LogMessage, chunk: ChunkHeader) -> list[Routed]:
        """A writer session began a new group: its older open groups in the partition can never complete."""
        return [
            decided
            for group in list(self._groups.get(message.partition, {}).values())
            if group.header.session == chunk.session
            for decided in self._abandon(
                message, group, f"a new chunk group {chunk.group} of the same writer began"
            )
        ]

    def _abandon_before_freeze(
        self, message: LogMessage, routed: list[Routed | Deferred]
    ) -> list[Routed | Deferred]:
        """A freeze first abandons its rollout's open groups: a group completing after the cut is never applied.

        Their masks go before the freeze (at lower indexes of its offset), so the snapshot it answers is incomplete.
        """
        decided: list[Routed | Deferred] = []
        for item in routed:
            if isinstance(item, ApplyEvent) and isinstance(item.event, FreezeEvent):
                rollout_id = item.event.rollout_id
                for group in list(self._groups.get(message.partition, {}).values()):
                    if rollout_of_key(group.key) == rollout_id:
                        decided.extend(
                            self._abandon(
                                message, group, f"its rollout was frozen at offset {message.offset} first"
                            )
                        )
            decided.append(item)
        return decided

    def _abandon_stale(self, message: LogMessage) -> list[Routed]:
        return [
            decided
            for group in list(self._groups.get(message.partition, {}).values())
            if message.offset - group.offsets[0] >= self.orphan_after_offsets
            for decided in self._abandon(
                message, group, f"still open {self.orphan_after_offsets} offsets later"
            )
        ]

    def _abandon(self, message: LogMessage, group: _OpenGroup, why: str) -> list[DeadLetter]:
        """Close a group that can never complete, decided while routing ``message``; its rollout is masked.

        A ghost is closed without a decision: its rollout is not this reader's.
        """
        partition = message.partition
        self._close(partition, group)
        if group.ghost:
            return []
        offsets = group.offsets
        where = f"{offsets}" if len(offsets) <= 8 else f"[{offsets[0]}, {offsets[1]}, ..., {offsets[-1]}]"
        reason = (
            f"orphaned chunk group {group.header.group}: {len(group.pieces)} of {group.header.count} chunks "
            f"at offsets {where}; {why}"
        )
        rollout_id = rollout_of_key(group.key)
        mask = (
            None
            if rollout_id is None
            else IncompleteEvent(rollout_id=rollout_id, writer=MATERIALIZER_WRITER, reason=reason)
        )
        return [
            DeadLetter(
                partition,
                group.offsets[0],
                group.headers,
                group.size,
                reason,
                rollout_id,
                mask,
                decided_at=message.offset,
            )
        ]

    @staticmethod
    def _dead_letter(message: LogMessage, headers: Mapping[str, str], size: int, reason: str) -> DeadLetter:
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


def _check_named_type(headers: Mapping[str, str], event: Event) -> None:
    """Refuse an event whose type header names another type: routing by the header would be misled."""
    named = headers.get(HEADER_TYPE)
    if named is not None and named != event.type.value:
        raise EventDecodeError(f"type header {named!r} does not name the event's type {event.type.value!r}")


def _indexed(routed: list[_Decided]) -> list[_Decided]:
    """Number the decisions routing one message took about each rollout, in their order (module docstring)."""
    taken: dict[str, int] = {}
    numbered: list[_Decided] = []
    for decided in routed:
        rollout_id = rollout_of(decided)
        if rollout_id is None:
            numbered.append(decided)
            continue
        index = taken.get(rollout_id, 0)
        taken[rollout_id] = index + 1
        if index and isinstance(decided, ApplyEvent | DeadLetter):
            decided = replace(decided, index=index)
        # A deferred message is a whole one, routed before anything it abandons: always its rollout's first.
        assert index == 0 or not isinstance(decided, Deferred), "a deferred message decided after another"
        numbered.append(decided)
    return numbered


def rollout_of(decided: Routed | Deferred) -> str | None:
    """The rollout whose files a decision changes; ``None`` for a chunk kept or a message that names none."""
    if isinstance(decided, ApplyEvent):
        return decided.event.rollout_id
    if isinstance(decided, DeadLetter | Deferred):
        return decided.rollout_id
    return None


def _tokens_of(decided: ApplyEvent | DeadLetter) -> int:
    """The prompt and generated tokens a decoded message holds in memory (a put's; none otherwise)."""
    if isinstance(decided, ApplyEvent) and isinstance(decided.event, PutEvent):
        return token_count(decided.event.entry)
    return 0

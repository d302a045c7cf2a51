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
only decides; ``carry_out`` applies a decision to a store, and only the materializer writes dead-letter lines.

Deferred decoding (the materializer's router): decoding and validating a put costs far more than reading its
headers, and a freeze waits for every message before it to be routed. A deferred message is decoded when its
own rollout needs it (that rollout's freeze is answered or its events are applied), or when the reader has
time to spare (``settle_oldest``). A rollout's messages are always decoded in their log order, whichever path
asks first, so wire deltas meet the same parents and every deferred message settles to the decision routing
it at once would have given. Commands, chunks, messages without a type header and keys that name no rollout
are never deferred.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokcap.errors import EventDecodeError, NewerSchemaError
from tokcap.events import (
    DeleteEvent,
    Event,
    FreezeEvent,
    IncompleteEvent,
    LedgerEvent,
    LedgerFailureEvent,
    LogPosition,
    PutEvent,
    RetireEvent,
    StageEvent,
)
from tokcap.hashing import sha256_hex
from tokcap.records import token_count
from tokcap.store import ApplyOutcome, ApplyResult, TokenCaptureStore
from transports.kafka.codec import (
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
from transports.kafka.dead_letters import REASON_LIMIT
from transports.kafka.delta_parents import ParentRestorer

__all__ = [
    "MATERIALIZER_WRITER",
    "ORPHAN_AFTER_OFFSETS",
    "ApplyEvent",
    "Buffered",
    "DeadLetter",
    "Deferred",
    "InboundRouter",
    "Routed",
    "carry_out",
    "refused_staging_reason",
]

MATERIALIZER_WRITER = "tokcap-materializer"
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

    ``mask`` marks the rollout the key names incomplete. A message's mask is applied at the message's log
    position; an abandoned group's has no single position (``positioned`` is false), so it is applied
    without one and guarded instead: by its reason, and by ``decided_at``, the offset of the message whose
    routing abandoned the group (a rollout already applied past it had the mask applied before).
    """

    partition: int
    offset: int
    headers: Mapping[str, str]
    size: int
    reason: str
    rollout_id: str | None
    mask: IncompleteEvent | None
    positioned: bool
    decided_at: int = -1


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


@dataclass
class _OpenGroup:
    """The chunks of one large event received so far."""

    header: ChunkHeader
    key: bytes
    headers: dict[str, str]
    offsets: list[int]
    pieces: list[bytes]
    size: int


@dataclass
class InboundRouter:
    """Routes messages partition by partition, holding the chunk groups still open in each."""

    orphan_after_offsets: int = ORPHAN_AFTER_OFFSETS
    parents: ParentRestorer = field(default_factory=ParentRestorer)
    """Restores wire deltas; give it a way to read the log (``OffsetReader``) where parents may be forgotten."""
    _groups: dict[int, dict[str, _OpenGroup]] = field(default_factory=dict)
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
        """Chunk groups still waiting for chunks, in every partition."""
        return sorted(group for groups in self._groups.values() for group in groups)

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
            if chunk is None:
                routed = [self._whole(message, headers, defer=defer)]
            else:
                routed = [*self._take_chunk(message, headers, chunk)]
        return self._abandon_before_freeze(message, routed) + self._abandon_stale(message)

    def pass_over(self, message: LogMessage) -> list[Routed]:
        """A message read but not routed (another rollout's): it can still make open groups abandoned.

        A reader of one rollout calls this for the others' messages, so it abandons exactly the groups
        the materializer, which reads them all, abandons.
        """
        routed: list[Routed] = []
        try:
            chunk = read_chunk_header(headers_to_dict(message.headers))
        except EventDecodeError:
            chunk = None
        if chunk is not None and chunk.index == 0:
            routed = self._abandon_session(message, chunk)
        return routed + self._abandon_stale(message)

    def rebuffer(self, message: LogMessage) -> None:
        """Take back a chunk of a group that was open at the checkpoint; it was checked when first read."""
        headers = headers_to_dict(message.headers)
        header = read_chunk_header(headers)
        if header is None:
            raise EventDecodeError(
                f"checkpointed chunk offset {message.offset} of partition {message.partition} is not a chunk; "
                "the checkpoint does not belong to this topic: replay into a new directory"
            )
        groups = self._groups.setdefault(message.partition, {})
        group = groups.get(header.group)
        if group is None:
            groups[header.group] = _OpenGroup(
                header, message.key or b"", headers, [message.offset], [message.value or b""], message.size
            )
            return
        group.offsets.append(message.offset)
        group.pieces.append(message.value or b"")
        group.size += message.size

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

    def _take_chunk(self, message: LogMessage, headers: dict[str, str], chunk: ChunkHeader) -> list[Routed]:
        """Add a chunk to its group; a completed group becomes its event."""
        key = message.key or b""
        value = message.value or b""
        size = message.size
        groups = self._groups.setdefault(message.partition, {})
        if chunk.index == 0:
            # The same session's older group, the same group id included, can no longer complete.
            abandoned = self._abandon_session(message, chunk)
            groups[chunk.group] = _OpenGroup(chunk, key, headers, [message.offset], [value], size)
            return [
                *abandoned,
                Buffered(message.partition, message.offset, headers, size, self._progress(chunk)),
            ]
        group = groups.get(chunk.group)
        if group is None:
            why = f"orphaned chunk {chunk.index}/{chunk.count} of group {chunk.group}"
            return [self._dead_letter(message, headers, size, why)]
        expected = (len(group.pieces), group.header.count, group.header.digest, group.key)
        if (chunk.index, chunk.count, chunk.digest, key) != expected:
            return [
                self._abandon(
                    message, group, f"chunk {chunk.index} at offset {message.offset} does not continue it"
                ),
                self._dead_letter(
                    message,
                    headers,
                    size,
                    f"chunk {chunk.index}/{chunk.count} does not continue group {chunk.group}",
                ),
            ]
        group.offsets.append(message.offset)
        group.pieces.append(value)
        group.size += size
        if len(group.pieces) < group.header.count:
            return [Buffered(message.partition, message.offset, headers, size, self._progress(chunk))]
        del groups[chunk.group]
        whole = b"".join(group.pieces)
        if sha256_hex(whole) != group.header.digest:
            why = f"chunk group {chunk.group} reassembles to a different digest"
            return [self._dead_letter(message, headers, group.size, why)]
        return [self._decode(message, group.key, whole, group.headers, group.size)]

    @staticmethod
    def _progress(chunk: ChunkHeader) -> str:
        return f"chunk {chunk.index + 1}/{chunk.count} of {chunk.group}"

    def _abandon_session(self, message: LogMessage, chunk: ChunkHeader) -> list[Routed]:
        """A writer session began a new group: its older open groups in the partition can never complete."""
        return [
            self._abandon(message, group, f"a new chunk group {chunk.group} of the same writer began")
            for group in list(self._groups.get(message.partition, {}).values())
            if group.header.session == chunk.session
        ]

    def _abandon_before_freeze(
        self, message: LogMessage, routed: list[Routed | Deferred]
    ) -> list[Routed | Deferred]:
        """A freeze first abandons its rollout's open groups: a group completing after the cut is never applied.

        Their masks go before the freeze, so the snapshot it answers is incomplete.
        """
        decided: list[Routed | Deferred] = []
        for item in routed:
            if isinstance(item, ApplyEvent) and isinstance(item.event, FreezeEvent):
                rollout_id = item.event.rollout_id
                decided.extend(
                    self._abandon(message, group, f"its rollout was frozen at offset {message.offset} first")
                    for group in list(self._groups.get(message.partition, {}).values())
                    if rollout_of_key(group.key) == rollout_id
                )
            decided.append(item)
        return decided

    def _abandon_stale(self, message: LogMessage) -> list[Routed]:
        return [
            self._abandon(message, group, f"still open {self.orphan_after_offsets} offsets later")
            for group in list(self._groups.get(message.partition, {}).values())
            if message.offset - group.offsets[0] >= self.orphan_after_offsets
        ]

    def _abandon(self, message: LogMessage, group: _OpenGroup, why: str) -> DeadLetter:
        """Close a group that can never complete, decided while routing ``message``; its rollout is masked."""
        partition = message.partition
        self._groups[partition].pop(group.header.group, None)
        reason = (
            f"orphaned chunk group {group.header.group}: {len(group.pieces)} of {group.header.count} chunks "
            f"at offsets {group.offsets}; {why}"
        )
        rollout_id = rollout_of_key(group.key)
        mask = (
            None
            if rollout_id is None
            else IncompleteEvent(rollout_id=rollout_id, writer=MATERIALIZER_WRITER, reason=reason)
        )
        return DeadLetter(
            partition,
            group.offsets[0],
            group.headers,
            group.size,
            reason,
            rollout_id,
            mask,
            positioned=False,
            decided_at=message.offset,
        )

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
            message.partition, message.offset, headers, size, reason, rollout_id, mask, positioned=True
        )


def _check_named_type(headers: Mapping[str, str], event: Event) -> None:
    """Refuse an event whose type header names another type: routing by the header would be misled."""
    named = headers.get(HEADER_TYPE)
    if named is not None and named != event.type.value:
        raise EventDecodeError(f"type header {named!r} does not name the event's type {event.type.value!r}")


def carry_out(store: TokenCaptureStore, topic: str, routed: Routed) -> ApplyResult | None:
    """Apply a routing decision to a store: the event, or the dead letter's mask; a buffered chunk is nothing yet.

    Return the store's verdict, ``None`` when nothing was applied.
    """
    if isinstance(routed, ApplyEvent):
        return store.apply(routed.event, LogPosition(topic, routed.partition, routed.offset))
    if isinstance(routed, Deferred):
        raise TypeError("a deferred decision is settled by its router before it is carried out")
    if isinstance(routed, Buffered) or routed.mask is None:
        return None
    if routed.positioned:
        return store.apply(routed.mask, LogPosition(topic, routed.partition, routed.offset))
    mask = routed.mask
    # A resumed materializer decides again; the rollout already went past that point, or holds the mark.
    if store.read_state(mask.rollout_id).already_applied(
        LogPosition(topic, routed.partition, routed.decided_at)
    ):
        return None
    if store.has_incomplete_mark(mask.rollout_id, mask.model_call_id, mask.reason):
        return None
    return store.apply(mask)


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


def _tokens_of(decided: ApplyEvent | DeadLetter) -> int:
    """The prompt and generated tokens a decoded message holds in memory (a put's; none otherwise)."""
    if isinstance(decided, ApplyEvent) and isinstance(decided.event, PutEvent):
        return token_count(decided.event.entry)
    return 0

"""The inbound router: what each message read from a run topic becomes, in log order.

Both readers of a topic route through here, the materializer and the timeline behind ``tokcap log`` and
``tokcap replay``, so they cannot disagree about a message. A message becomes one of (``decisions``):

- ``ApplyEvent``: a whole event, or the last chunk of a complete chunk group, to apply at its log position;
- ``Buffered``: a chunk that waits for the rest of its group;
- ``Deferred``: a whole capture message (intent, cancel, put, incomplete) of a valid rollout key, routed by its
  headers and key alone when the router defers decoding; ``settle`` decodes it later into one of the others;
- ``DeadLetter``: a message that cannot be applied (undecodable headers or value, unknown type, newer schema,
  an event the sinks' input rules refuse, a key that does not name the event's rollout, a chunk that
  continues no group, a group whose bytes do not match their digest), or a chunk group that can never
  complete. Where the key names a valid rollout, the
  dead letter carries the incomplete mark that masks it.

Chunks are held, and chunk groups abandoned within the topic's memory limits, by ``chunk_groups``; the router
decodes what a group completes to. A freeze abandons its rollout's open groups before it applies: whatever
completes after the cut is never part of the snapshot, so a snapshot taken while a group is open must be
masked, not returned complete. The router only decides: the readers that keep a store carry its decisions
out (``apply``), and only the materializer writes dead-letter lines.

Every decision has a log position: the offset of the message whose routing took it, and its ``index`` among the
decisions about the same rollout routing that message took, in their order. An abandoned group's mask thus sits
before the freeze that abandoned it, and a resumed reader that decides again finds it applied, as any event.
The index counts per rollout, so a reader of some rollouts, which passes over the others' messages, gives each
of its decisions the position the materializer gives it.

A whole message is not checked against the limits: the broker's message limit
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

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import TypeVar

from tokcap.errors import EventDecodeError, NewerSchemaError
from tokcap.log.events import DeleteEvent, Event, FreezeEvent, PutEvent, RetireEvent
from tokcap.log.records import token_count
from transports.kafka.wire.chunk_groups import ORPHAN_AFTER_OFFSETS, ChunkGroups, logger
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
from transports.kafka.wire.decisions import (
    MATERIALIZER_WRITER,
    ApplyEvent,
    Buffered,
    DeadLetter,
    Deferred,
    Routed,
    dead_letter,
    rollout_of,
)
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

_DEFERRABLE_TYPES = frozenset({"intent", "cancel", "put", "incomplete"})
"""Type headers of the messages whose decoding may wait: a rollout's capture, never a command a source waits on."""

_PARENT_FREE_TYPES = frozenset({"freeze", "drop"})
"""Type headers of the commands whose decoding never meets the parent restorer (a delete or retire makes it forget
the rollout's parents, so it must come after them). Routing a plain one leaves its rollout's deferred capture
deferred: a burst of freezes is then not held up by decoding every rollout's puts before the first is carried out,
and each rollout's puts are decoded when its own freeze is."""

_Decided = TypeVar("_Decided", Routed, Routed | Deferred)
"""The decisions of one message, as routing or passing over it returns them."""


class InboundRouter:
    """Routes messages partition by partition; its chunk groups hold the chunks still open in each.

    ``limits`` bound the memory chunks take (``chunk_groups``); every reader of a topic must use the topic's
    own (``limits_record``), or they may decide differently about a large group.
    """

    def __init__(
        self,
        orphan_after_offsets: int = ORPHAN_AFTER_OFFSETS,
        limits: TopicLimits = TOPIC_DEFAULTS,
        topic: str = "",
        parents: ParentRestorer | None = None,
        payloads: StagedPayloadRestorer | None = None,
    ) -> None:
        self.topic = topic
        """The topic read, for messages."""
        self.parents = parents if parents is not None else ParentRestorer()
        """Restores wire deltas; give it a way to read the log (``OffsetReader``) where parents may be forgotten."""
        self.payloads = payloads if payloads is not None else StagedPayloadRestorer()
        """Restores staged references; give it a way to read the staged-payload topic (``staged_payloads``)."""
        self._chunks = ChunkGroups(orphan_after_offsets, limits)
        self._deferred: dict[bytes, deque[Deferred]] = {}
        """Per key, its deferred messages not settled yet, in log order."""
        self._arrived: deque[Deferred] = deque()
        """Every deferred message in the order it was routed; those settled meanwhile are skipped."""
        self.decoded_ahead_tokens = 0
        """Tokens of the puts ``settle_oldest`` decoded that nobody has asked for yet: memory a reader that
        decodes ahead holds on top of the messages' bytes, which it may bound."""

    @property
    def limits(self) -> TopicLimits:
        """The topic's limits: the largest reassembled value and the open groups' budget per partition."""
        return self._chunks.limits

    @limits.setter
    def limits(self, limits: TopicLimits) -> None:
        self._chunks.limits = limits

    # ------------------------------------------------------------ what is open

    def open_chunk_offsets(self, partition: int) -> list[int]:
        """The offsets of every chunk of the partition's open groups: a resume must read them again."""
        return self._chunks.open_chunk_offsets(partition)

    def open_groups(self) -> list[str]:
        """Chunk groups still waiting for chunks, in every partition (another rollout's seen by ``pass_over``
        excluded)."""
        return self._chunks.open_groups()

    def open_chunk_bytes(self, partition: int) -> int:
        """Value bytes the partition's open groups hold (``max_open_chunk_bytes`` bounds it)."""
        return self._chunks.open_chunk_bytes(partition)

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
            routed = [dead_letter(message, {}, message.size, f"undecodable headers: {exc}")]
        else:
            if chunk is None and is_limits_record(headers):
                self._check_limits_record(message, headers)
                routed = []
            elif chunk is None:
                routed = [self._whole(message, headers, defer=defer)]
            else:
                routed = [*self._take_chunk(message, headers, chunk)]
        return _indexed([*self._abandon_before_freeze(message, routed), *self._chunks.abandon_stale(message)])

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
            taken, _ = self._chunks.take(message, headers, chunk, ghost=True)
            routed = [decided for decided in taken if isinstance(decided, DeadLetter) and decided.abandoned]
        elif headers.get(HEADER_TYPE) == "freeze":
            self._close_frozen_ghosts(message, headers)
        elif is_limits_record(headers):
            self._check_limits_record(message, headers)
        return _indexed(routed + self._chunks.abandon_stale(message))

    def _close_frozen_ghosts(self, message: LogMessage, headers: Mapping[str, str]) -> None:
        """A freeze passed over closes its rollout's ghost groups, as routing it closes the groups it abandons."""
        try:
            event = decode_message(message.key, message.value, headers)
        except (EventDecodeError, NewerSchemaError):
            return
        if isinstance(event, FreezeEvent):
            self._chunks.close_frozen_ghosts(message.partition, event.rollout_id)

    def rebuffer(self, message: LogMessage) -> None:
        """Take back a chunk of a group that was open at the checkpoint; it was checked when first read."""
        self._chunks.rebuffer(message, headers_to_dict(message.headers))

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
        rollout's messages always meet the parent restorer in log order; a plain freeze or drop, which never meets
        it, leaves them deferred (``_PARENT_FREE_TYPES``). A whole put is kept as a possible
        parent. An event whose type is not the one its header names is refused: a reader that routes by the
        header must not be misled by it.
        """
        if settle_first and key is not None and key in self._deferred and not _parent_free(headers):
            self._settle_key(key)
        try:
            if is_wire_delta(headers):
                delta = decode_wire_delta(key, value, headers)
                event: Event = self.parents.restore(
                    key or b"", message.partition, message.offset, delta, keep=whole
                )
                _check_named_type(headers, event)
            elif is_staged_reference(headers):
                event, payload_size = self.payloads.restore(key, value, headers, self.limits)
                _check_named_type(headers, event)
                # The payload is held with the decision: the reader's read-ahead counts its bytes.
                size = max(size, payload_size)
            else:
                event = decode_message(key, value, headers)
                _check_named_type(headers, event)
                if whole and isinstance(event, PutEvent):
                    self.parents.remember(key or b"", message.partition, message.offset, event)
        except (EventDecodeError, NewerSchemaError) as exc:
            return dead_letter(message, headers, size, str(exc))
        if isinstance(event, RetireEvent | DeleteEvent):
            self.parents.forget(key or b"")
        return ApplyEvent(event, message.partition, message.offset, headers, size)

    def _take_chunk(self, message: LogMessage, headers: dict[str, str], chunk: ChunkHeader) -> list[Routed]:
        """Add a chunk to its group; a completed group becomes its event."""
        decided, completed = self._chunks.take(message, headers, chunk)
        if completed is None:
            return decided
        event = self._decode(message, completed.key, completed.value, completed.headers, completed.size)
        return [*decided, event]

    def _abandon_before_freeze(
        self, message: LogMessage, routed: list[Routed | Deferred]
    ) -> list[Routed | Deferred]:
        """A freeze first abandons its rollout's open groups: a group completing after the cut is never applied.

        Their masks go before the freeze (at lower indexes of its offset), so the snapshot it answers is incomplete.
        """
        decided: list[Routed | Deferred] = []
        for item in routed:
            if isinstance(item, ApplyEvent) and isinstance(item.event, FreezeEvent):
                decided.extend(self._chunks.abandon_frozen(message, item.event.rollout_id))
            decided.append(item)
        return decided


def _parent_free(headers: Mapping[str, str]) -> bool:
    """Whether decoding this message cannot meet the parent restorer: a plain freeze or drop, no delta or reference."""
    return (
        headers.get(HEADER_TYPE) in _PARENT_FREE_TYPES
        and not is_wire_delta(headers)
        and not is_staged_reference(headers)
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


def _tokens_of(decided: ApplyEvent | DeadLetter) -> int:
    """The prompt and generated tokens a decoded message holds in memory (a put's; none otherwise)."""
    if isinstance(decided, ApplyEvent) and isinstance(decided.event, PutEvent):
        return token_count(decided.event.entry)
    return 0

"""What the lineage resolver knows of each rollout: its log folded through the rules, indexed for a resolve.

Each put is indexed by its JSON head (call id, fingerprint, context digest, lengths, digest, parent link) and
its payload digest, the one every store compares (``PutEvent.payload_digest``; a wire delta carries it); the
token arrays are kept as the bytes that arrived and are decoded again for the one proven parent's chain only.
A put too large for one message is reassembled by the inbound router (``router``), with its digest check and
memory limits, and decoded whole there; the chunks of other large events are counted towards those limits but
not kept.

Every put is checked by the sinks' input rules as it is read: its head by the rules on the entry's fields,
its ids on their packed bytes (``codec.read_packed_head``); a put refused is no candidate. A put whose decoded
arrays fail the rules has no payload digest and is told apart by its bytes; the rules that need decoded arrays
apply again when the chain is decoded (``codec.decode_event_value``); a refusal there leaves
the request unresolved (``LineageLookupError``). So a put the materializer dead-letters never resolves a
parent.

The log is folded through the rules the materializer applies (``tokcap.log.rules.decide``), so the resolver's
verdicts on a rollout's lifecycle are the store's: puts after a freeze are no candidates (the store refuses
them), a drop of the snapshot and version frozen or a retire forgets the rollout's calls (a later continuation
is unresolved, which is always safe), a drop the rules refuse as stale forgets nothing, and a delete starts
the rollout afresh. Only a command changes the lifecycle, so the other events of a rollout are kept as read
and decided at its next command; an event the materializer dead-letters is decided as the mask it applies.
Like the ledger-only projection, the resolver passes over staged calls unread.
State is kept for every rollout seen and not retired, so memory follows the live rollouts. The last parent
materialized for each rollout is kept too (``max_kept_tokens`` overall), so a resolve decodes and packs only
the puts after it: its cost follows what was appended since, not the rollout's length.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokcap.errors import EventDecodeError, LineageLookupError, NewerSchemaError
from tokcap.lineage import (
    KeptParents,
    LineageIndex,
    LineageNode,
    LineageResolution,
    materialize_tokens,
    resolution_of,
)
from tokcap.log.events import (
    LOG_READER_WRITER,
    DeleteEvent,
    DropEvent,
    Event,
    FreezeEvent,
    IncompleteEvent,
    LedgerEvent,
    LogPosition,
    PutEvent,
    RetireEvent,
)
from tokcap.log.hashing import sha256_hex
from tokcap.log.records import TokenEntry
from tokcap.log.rules import decide
from tokcap.log.state import RolloutState
from transports.kafka.wire.codec import (
    ENCODING_DELTA,
    ENCODING_JSON,
    ENCODING_PACKED,
    HEADER_ENCODING,
    HEADER_TYPE,
    ConsumedMessage,
    LogMessage,
    decode_event_value,
    decode_wire_delta,
    encode_event_value,
    header_pairs,
    headers_to_dict,
    read_chunk_header,
    read_packed_head,
    rollout_of_key,
)
from transports.kafka.wire.dead_letter_reason import REASON_LIMIT
from transports.kafka.wire.delta_parents import DEFAULT_KEPT_TOKENS, ParentRestorer
from transports.kafka.wire.router import ApplyEvent, DeadLetter, InboundRouter
from transports.kafka.wire.topic_limits import TopicLimits

__all__ = ["RolloutLog", "RolloutLogs", "StoredPut"]

_ARRAYS = frozenset({"prompt_token_ids", "generation_token_ids", "generation_log_probs"})
_COMMANDS = (FreezeEvent, DropEvent, RetireEvent, DeleteEvent)
"""The events that change a rollout's lifecycle: the rules decide each over every event before it."""
_PASSED_OVER = frozenset({"stage"})
"""Event types never read, as the ledger-only projection passes them over: a staged call holds no tokens."""
_RESTORE_STRIPES = 8
"""Wire-delta restorers, each with its own lock, serving a share of the rollouts."""


def _put_digest(event: Event) -> str:
    """A put's payload digest (``PutEvent.payload_digest``, the one every store compares); a packed value
    decodes to a put or is refused."""
    if not isinstance(event, PutEvent):
        raise EventDecodeError(f"a packed value must be a put event, got {event.type.value}")
    return event.payload_digest


@dataclass
class StoredPut:
    """One put's undecoded value, decoded only if its call is on a proven parent's chain."""

    value: bytes
    headers: dict[str, str]
    key: bytes = b""
    partition: int = 0
    offset: int = -1
    """Where the put was read; -1 for one reassembled from chunks (never a wire delta's parent)."""
    call_id: str = ""

    def as_message(self) -> LogMessage:
        """The put as the log message it was read as."""
        return LogMessage(self.partition, self.offset, None, self.key, header_pairs(self.headers), self.value)


@dataclass
class RolloutLog:
    """What the log says about one rollout's calls so far.

    ``state`` is the rollout as the rules (``tokcap.log.rules.decide``) left it at its last lifecycle command;
    ``undecided`` holds every event read since, in log order, for the rules to decide at the next one. Only a
    command changes the lifecycle, so whether a put is a candidate is known from ``state`` alone, and the
    arrays of a put are decoded for the rules only when a command of its rollout is read.
    """

    state: RolloutState
    index: LineageIndex = field(default_factory=LineageIndex)
    puts: dict[str, StoredPut] = field(default_factory=dict)
    undecided: list[tuple[LogPosition | None, Event | StoredPut]] = field(default_factory=list)
    ledger_rows: bool = False
    """Whether a ledger row of the rollout was read: a continuation no put resolves may continue one."""
    at: dict[int, StoredPut] = field(default_factory=dict)
    """Whole put messages by offset: the parents a wire delta of this rollout may link."""

    @classmethod
    def of(cls, rollout_id: str) -> RolloutLog:
        """A rollout nothing was read of yet."""
        return cls(RolloutState(rollout_id=rollout_id))

    def keep(self, position: LogPosition | None, event: Event | StoredPut) -> bool:
        """Keep an event for the rules to decide at the next command; a retired rollout's fence refuses it."""
        if self.state.retired:
            return False
        self.undecided.append((position, event))
        return True


class RolloutLogs:
    """Every rollout read of one topic and not retired: folded by the caller's reader, answered by the resolver.

    Folding is not thread-safe (the resolver folds under its lock). Answering needs no lock: a rollout's
    recorded calls are only ever added to, and a reader that folded up to the call's end already holds every
    call the decision may need.
    """

    def __init__(self, topic: str, max_kept_tokens: int) -> None:
        self._topic = topic
        self._rollouts: dict[str, RolloutLog] = {}
        self._parents = KeptParents(max_kept_tokens)
        """Each rollout's last materialized parent, kept with the log it was read from."""
        self._chunk_router = InboundRouter(topic=topic)
        """Reassembles chunk groups, the one way every reader does, by the topic's limits (read before the first
        partition is assigned)."""
        # Restoring is CPU work on one rollout; striped by rollout so concurrent calls do not queue on one lock,
        # with the kept tokens still bounded overall.
        self._restorers = [
            (threading.Lock(), ParentRestorer(max_tokens=DEFAULT_KEPT_TOKENS // _RESTORE_STRIPES))
            for _ in range(_RESTORE_STRIPES)
        ]

    def use_limits(self, limits: TopicLimits) -> None:
        """Reassemble chunk groups by the topic's limits, as every other reader of it does."""
        self._chunk_router.limits = limits

    def clear(self) -> None:
        """Forget every rollout, open chunk group and kept parent (the resolver is closing)."""
        self._rollouts.clear()
        self._chunk_router = InboundRouter(topic=self._topic, limits=self._chunk_router.limits)
        self._parents.clear()

    def has_ledger_rows(self, rollout_id: str) -> bool:
        """Whether a ledger row of the rollout was read: a continuation no put resolves may continue one."""
        log = self._rollouts.get(rollout_id)
        return log is not None and log.ledger_rows

    def current(self, rollout_id: str) -> RolloutLog:
        """The rollout's log as read so far (an empty one, not kept, when nothing was)."""
        return self._rollouts.get(rollout_id) or RolloutLog.of(rollout_id)

    def answer(
        self, log: RolloutLog, request_items: Sequence[Any], fingerprint: str | None
    ) -> LineageResolution:
        """The decision over what has been read of the rollout's log so far."""
        rollout_id = log.state.rollout_id
        # Hashing the request's context needs no lock either: the reader only adds to this log's index (one
        # read and folded up to this call's end already holds every call the decision may need).
        status, node, reason = log.index.decide(request_items, fingerprint)
        if node is None:
            return resolution_of(status, None, reason)
        # Decoding the winner's arrays needs no lock: a rollout's recorded calls are only ever added to.
        # The parent materialized last for this same log is the base: only the puts after it are decoded.
        known = self._parents.get(rollout_id, log)
        materialized = materialize_tokens(
            node, log.index, lambda ids: [self._entry_of(log, i) for i in ids], known
        )
        if materialized is not known:
            self._parents.keep(rollout_id, log, materialized)
        return resolution_of(status, node, reason, materialized.tokens)

    def take(self, message: ConsumedMessage, partition: int, offset: int) -> None:
        """Fold one message the consumer read at ``partition``/``offset``; one that cannot be decoded is masked."""
        rollout_id = rollout_of_key(message.key())
        value = message.value()
        if rollout_id is None or value is None:
            return
        try:
            headers = headers_to_dict(message.headers())
            if read_chunk_header(headers) is not None:
                if headers.get(HEADER_TYPE) == "put":
                    self._take_chunk(LogMessage.of(message))
                else:
                    # A large stage (media, routed experts) is no candidate: its bytes are counted, not kept.
                    self._chunk_router.pass_over(LogMessage.of(message))
                return
            self.fold(rollout_id, value, headers, partition, offset)
        except (
            EventDecodeError,
            NewerSchemaError,
            orjson.JSONDecodeError,
            ValueError,
            KeyError,
            TypeError,
        ) as exc:
            # The materializer dead-letters what it cannot decode and masks the rollout; for lineage it is no
            # candidate, and the mask moves the version a later drop is judged by.
            where = f"partition {partition} offset {offset}"
            self._mask(rollout_id, LogPosition(self._topic, partition, offset), f"{where}: {exc}")

    def _take_chunk(self, message: LogMessage) -> None:
        """Reassemble through the inbound router, with its checks and memory limits; fold a completed event.

        A group the router dead-letters is no candidate; its mask is decided as the materializer decides it. A
        completed put is folded as its packed value, which the router already decoded and checked whole.
        """
        for decided in self._chunk_router.route(message):
            if isinstance(decided, ApplyEvent):
                event = decided.event
                encoding, value = (
                    encode_event_value(event) if isinstance(event, PutEvent) else (ENCODING_JSON, b"")
                )
                headers = {**decided.headers, HEADER_ENCODING: encoding}
                position = decided.position(self._topic)
                self.fold(event.rollout_id, value, headers, decided.partition, -1, position)
            elif isinstance(decided, DeadLetter) and decided.mask is not None:
                self._log_of(decided.mask.rollout_id).keep(decided.position(self._topic), decided.mask)

    def _log_of(self, rollout_id: str) -> RolloutLog:
        """The rollout's log, begun empty the first time one of its events is read."""
        log = self._rollouts.get(rollout_id)
        if log is None:
            log = self._rollouts[rollout_id] = RolloutLog.of(rollout_id)
        return log

    def _mask(self, rollout_id: str, position: LogPosition, why: str) -> None:
        """Keep the mask the materializer applies for an event it dead-letters, for the rules to decide."""
        reason = f"dead-lettered event at {why}"[:REASON_LIMIT]
        mask = IncompleteEvent(rollout_id=rollout_id, writer=LOG_READER_WRITER, reason=reason)
        self._log_of(rollout_id).keep(position, mask)

    def fold(
        self,
        rollout_id: str,
        value: bytes,
        headers: dict[str, str],
        partition: int = 0,
        offset: int = -1,
        position: LogPosition | None = None,
    ) -> None:
        """Fold one event read at ``offset`` (-1: reassembled from chunks, or handed over without a position).

        A put is indexed while its rollout is open and kept, as every other event, for the rules to decide at
        the rollout's next lifecycle command (``_decide``), which is decided at once.
        """
        kind = headers.get(HEADER_TYPE, "")
        if kind in _PASSED_OVER:
            return
        if position is None and offset >= 0:
            position = LogPosition(self._topic, partition, offset)
        log = self._log_of(rollout_id)
        if kind == "put":
            stored = self._index_put(log, rollout_id, value, headers, partition, offset)
            if log.keep(position, stored) and offset >= 0:
                log.at[offset] = stored
            return
        event = decode_event_value(value, headers)
        if event.rollout_id != rollout_id:
            raise EventDecodeError(f"the key names rollout {rollout_id!r}, the event {event.rollout_id!r}")
        if isinstance(event, _COMMANDS):
            self._decide(log, event, position)
            return
        if isinstance(event, LedgerEvent):
            log.ledger_rows = True
        log.keep(position, event)

    def _decide(self, log: RolloutLog, command: Event, position: LogPosition | None) -> None:
        """Decide a lifecycle command by the rules, over every event of the rollout read before it.

        The verdicts are the materializer's: a drop retires only the snapshot and version frozen, a retire
        always, a delete starts the rollout afresh; a retired rollout's calls are forgotten.
        """
        rollout_id = log.state.rollout_id
        state = log.state
        for at, item in log.undecided:
            event = item if not isinstance(item, StoredPut) else self._put_or_mask(log, item, at)
            state = decide(state, event, at).state
        log.undecided.clear()
        # A command handed over without a position (never by the consumer) names its snapshot by the topic.
        state = decide(state, command, position, new_snapshot_id=f"{self._topic}:unpositioned").state
        if isinstance(command, DeleteEvent):
            self._rollouts.pop(rollout_id, None)
            self._parents.forget(rollout_id)
        elif state.retired:
            self._rollouts[rollout_id] = RolloutLog(state)
            self._parents.forget(rollout_id)
        else:
            log.state = state

    def _put_or_mask(self, log: RolloutLog, stored: StoredPut, position: LogPosition | None) -> Event:
        """A kept put decoded whole for the rules, or the mask the materializer applies when it cannot be."""
        try:
            return self._put_of(log, stored)
        except LineageLookupError as exc:
            where = (
                "a reassembled put"
                if position is None
                else f"partition {position.partition} offset {position.offset}"
            )
            reason = f"dead-lettered event at {where}: {exc}"[:REASON_LIMIT]
            return IncompleteEvent(rollout_id=log.state.rollout_id, writer=LOG_READER_WRITER, reason=reason)

    def _index_put(
        self,
        log: RolloutLog,
        rollout_id: str,
        value: bytes,
        headers: dict[str, str],
        partition: int,
        offset: int,
    ) -> StoredPut:
        """Keep a put as read and, while its rollout is open and its head proves a call, index it as a candidate."""
        stored = StoredPut(value, headers, rollout_id.encode(), partition, offset)
        if not log.state.is_open:
            return stored
        encoding = headers.get(HEADER_ENCODING, ENCODING_JSON)
        if encoding == ENCODING_DELTA:
            delta = decode_wire_delta(rollout_id.encode(), value, headers)
            delta.check_head()
            link = delta.link
            parent = log.at.get(link.offset)
            if link.partition != partition or parent is None or parent.call_id != link.model_call_id:
                # Not provable from what this resolver read of the rollout (a parent from before a delete,
                # say): not a candidate, which is always safe.
                return stored
            entry = {k: v for k, v in delta.mapping["entry"].items() if k not in _ARRAYS}
            generation = delta.mapping["entry"].get("generation_token_ids") or []
            token_count = delta.prompt_count + len(generation)
            # The sink's ``PutEvent.payload_digest`` of the whole entry, which restoring it proves.
            payload = delta.entry_digest
        elif encoding == ENCODING_PACKED:
            entry, token_count, _ = read_packed_head(value)
            try:
                payload = _put_digest(decode_event_value(value, headers))
            except EventDecodeError:
                # Its arrays fail the input rules once decoded, so it has no canonical line: its bytes tell it
                # apart, and a request continuing it fails when its arrays are decoded for the answer.
                payload = sha256_hex(value)
        else:
            event = decode_event_value(value, headers)
            if not isinstance(event, PutEvent):
                return stored
            entry = dict(event.entry.__dict__)
            token_count = len(event.entry.prompt_token_ids) + len(event.entry.generation_token_ids)
            payload = event.payload_digest
        if entry.get("rollout_id") != rollout_id:
            return stored
        node = LineageNode.from_fields(entry, token_count=token_count, payload=payload)
        if node is None:
            return stored
        log.index.add(node)
        stored.call_id = node.call_id
        log.puts.setdefault(node.call_id, stored)
        return stored

    def _restored(self, log: RolloutLog, stored: StoredPut) -> PutEvent:
        """A wire delta's exact put, rebuilt from the rollout's whole puts read so far; its digest is checked.

        A few restorers, each for a share of the rollouts, keep recent parents (bounded in tokens); a parent
        one forgot is taken again from the rollout's puts this resolver read.
        """

        def read(partition: int, offset: int) -> LogMessage | None:
            parent = log.at.get(offset)
            return None if parent is None or parent.partition != partition else parent.as_message()

        lock, restorer = self._restorers[zlib.crc32(stored.key) % _RESTORE_STRIPES]
        with lock:
            try:
                delta = decode_wire_delta(stored.key, stored.value, stored.headers)
                return restorer.restore(stored.key, stored.partition, stored.offset, delta, read=read)
            except (EventDecodeError, NewerSchemaError) as exc:
                raise LineageLookupError(
                    f"call {stored.call_id}'s wire delta cannot be restored: {exc}"
                ) from exc

    def _entry_of(self, log: RolloutLog, call_id: str) -> TokenEntry:
        stored = log.puts.get(call_id)
        if stored is None:
            raise LineageLookupError(f"call {call_id} is indexed but its record was not kept")
        return self._put_of(log, stored).entry

    def _put_of(self, log: RolloutLog, stored: StoredPut) -> PutEvent:
        """A kept put decoded whole, its wire delta restored; ``LineageLookupError`` when it cannot be."""
        what = f"call {stored.call_id}" if stored.call_id else "a put"
        if stored.headers.get(HEADER_ENCODING) == ENCODING_DELTA:
            return self._restored(log, stored)
        try:
            event = decode_event_value(stored.value, stored.headers)
        except (EventDecodeError, NewerSchemaError) as exc:
            raise LineageLookupError(f"the record kept for {what} cannot be decoded: {exc}") from exc
        if not isinstance(event, PutEvent):
            raise LineageLookupError(f"the record kept for {what} is not a put")
        return event

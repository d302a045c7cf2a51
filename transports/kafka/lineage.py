"""Gym's ``LineageResolver`` over a run topic: request-time parent lookup straight from the Kafka log.

A rollout's events are keyed by its id, so they all sit, in order, in one partition.
Before answering, ``resolve`` reads that partition up to its end as of the call (its high watermark,
asked of the broker each time), so any ``put`` acknowledged before the call is seen: read-your-writes
per rollout, on any node, including a resolver built after the put.

Each put is indexed by its JSON head (call id, fingerprint, context digest, lengths, digest, parent link) and
its payload digest, the one every store compares (``PutEvent.payload_digest``; a wire delta carries it); the
token arrays are kept as the bytes that arrived and are decoded again for the one proven parent's chain only.
Kafka has no partial fetch, so the bytes do cross the wire. A put too large for one message is reassembled by
the inbound router (``router``), with its digest check and memory limits, and decoded whole there; the chunks
of other large events are counted towards those limits but not kept.

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

Nameable in the config block as ``lineage_store: transports.kafka.lineage:KafkaLineageResolver`` with
``lineage_store_kwargs: {bootstrap_servers: ..., topic: ...}`` (or ``run_id``). It is Gym's ``CaptureLedger``
for engine-side staging too (``transports.kafka.ledger.KafkaCaptureLedger``): ledger rows are events on the
topic, read back from a materializer's projection, and a continuation no put resolves is looked up among the
committed ledger rows, as the file resolver does. The projection lives in ``store_dir`` when given; without
it, in a ledger-only projection in a directory the process makes for itself (``private_projection``), so the
one block every model server reads needs no per-process setting. It is started at the first ledger call, or
at the first continuation whose rollout has ledger rows on the topic: a resolver of puts alone never starts it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import OFFSET_END, Consumer, KafkaException, Message, TopicPartition

from tokcap.errors import ConfigError, EventDecodeError, LineageLookupError, NewerSchemaError, TransportError
from tokcap.fingerprint import assistant_fingerprint
from tokcap.ledger import PendingRollout
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
from tokcap.log.records import ParentResolutionStatus, TokenEntry
from tokcap.log.rules import decide
from tokcap.log.state import RolloutState
from tokcap.metrics import source_timed
from transports.kafka.client.admin import partition_count
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, assign_reader, open_reader
from transports.kafka.client.error_map import Request, read_failure, translated
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.client.topics import resolve_topic
from transports.kafka.ledger import DEFAULT_STAGE_TIMEOUT_S, KafkaCaptureLedger
from transports.kafka.wire.codec import (
    ENCODING_DELTA,
    ENCODING_JSON,
    ENCODING_PACKED,
    HEADER_ENCODING,
    HEADER_TYPE,
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
from transports.kafka.wire.partitioner import PARTITIONERS, partition_of_rollout
from transports.kafka.wire.router import ApplyEvent, DeadLetter, InboundRouter
from transports.kafka.wire.topic_limits import TopicLimits

__all__ = ["KafkaLineageResolver"]

_ARRAYS = frozenset({"prompt_token_ids", "generation_token_ids", "generation_log_probs"})
_COMMANDS = (FreezeEvent, DropEvent, RetireEvent, DeleteEvent)
"""The events that change a rollout's lifecycle: the rules decide each over every event before it."""
_PASSED_OVER = frozenset({"stage"})
"""Event types never read, as the ledger-only projection passes them over: a staged call holds no tokens."""
_FOLD_STEP = 16
"""Messages folded per hold of the lock."""
_RESTORE_STRIPES = 8
"""Wire-delta restorers, each with its own lock, serving a share of the rollouts."""


def _put_digest(event: Event) -> str:
    """A put's payload digest (``PutEvent.payload_digest``, the one every store compares); a packed value
    decodes to a put or is refused."""
    if not isinstance(event, PutEvent):
        raise EventDecodeError(f"a packed value must be a put event, got {event.type.value}")
    return event.payload_digest


class _SharedQuestion:
    """One broker question, for every partition asked about, answering every caller that arrived before it was sent.

    A caller that finds a question in flight adds its partition to the next one and waits for it, which is
    sent after the caller arrived: no answer is older than the call it answers (read-your-writes). Concurrent
    callers, whatever their partitions, cost two round trips rather than one queued round trip each.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._asking = False
        self._sent = 0
        self._wanted: set[int] = set()
        """The partitions the next question will ask about."""
        self._answers: dict[int, tuple[int, int | BaseException]] = {}
        """Per partition: the number of the last question that asked about it, and its answer or failure."""

    def ask(self, partition: int, question: Callable[[frozenset[int]], Mapping[int, int]]) -> int:
        """The partition's answer from a question sent after this call began (this caller's or another's)."""
        with self._condition:
            wanted = self._sent + 1
            self._wanted.add(partition)
            while self._answers.get(partition, (0, 0))[0] < wanted:
                if self._asking:
                    self._condition.wait()
                    continue
                self._asking = True
                self._sent += 1
                number, partitions = self._sent, frozenset(self._wanted)
                self._wanted = set()
                self._condition.release()
                answers: dict[int, int | BaseException] = {}
                try:
                    answered = question(partitions)
                    for asked in partitions:
                        answers[asked] = answered.get(
                            asked, TransportError(f"no end offset for partition {asked}")
                        )
                except BaseException as exc:
                    answers = dict.fromkeys(partitions, exc)
                finally:
                    self._condition.acquire()
                    self._asking = False
                    for asked in partitions:
                        self._answers[asked] = (
                            number,
                            answers.get(asked, TransportError("question not sent")),
                        )
                    self._condition.notify_all()
            answer = self._answers[partition][1]
            if isinstance(answer, BaseException):
                raise answer
            return answer


@dataclass
class _StoredPut:
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
class _RolloutLog:
    """What the log says about one rollout's calls so far.

    ``state`` is the rollout as the rules (``tokcap.log.rules.decide``) left it at its last lifecycle command;
    ``undecided`` holds every event read since, in log order, for the rules to decide at the next one. Only a
    command changes the lifecycle, so whether a put is a candidate is known from ``state`` alone, and the
    arrays of a put are decoded for the rules only when a command of its rollout is read.
    """

    state: RolloutState
    index: LineageIndex = field(default_factory=LineageIndex)
    puts: dict[str, _StoredPut] = field(default_factory=dict)
    undecided: list[tuple[LogPosition | None, Event | _StoredPut]] = field(default_factory=list)
    ledger_rows: bool = False
    """Whether a ledger row of the rollout was read: a continuation no put resolves may continue one."""
    at: dict[int, _StoredPut] = field(default_factory=dict)
    """Whole put messages by offset: the parents a wire delta of this rollout may link."""

    @classmethod
    def of(cls, rollout_id: str) -> _RolloutLog:
        """A rollout nothing was read of yet."""
        return cls(RolloutState(rollout_id=rollout_id))

    def keep(self, position: LogPosition | None, event: Event | _StoredPut) -> bool:
        """Keep an event for the rules to decide at the next command; a retired rollout's fence refuses it."""
        if self.state.retired:
            return False
        self.undecided.append((position, event))
        return True


class KafkaLineageResolver:
    """Resolves each request's parent from the run topic, with Gym 0.7.0's decisions and hashes."""

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        run_id: str | None = None,
        topic: str | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        partitioner: str = "consistent_random",
        timeout_s: float = 10.0,
        threads: int = 32,
        max_kept_tokens: int = 8_000_000,
        store_dir: str | Path | None = None,
        delivery_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S,
        producer_config: Mapping[str, Any] | None = None,
    ) -> None:
        """The resolver is Gym's ``CaptureLedger`` too (engine-side staging): ledger rows are events on the topic,
        read back from a materializer's projection of it, in ``store_dir`` when given (a whole projection, which
        sources of this process may share), else in a ledger-only one of this process's own.
        """
        if not bootstrap_servers:
            raise ConfigError("bootstrap_servers must name at least one broker")
        if partitioner not in PARTITIONERS:
            raise ConfigError(
                f"partitioner {partitioner!r} is not one of {', '.join(sorted(PARTITIONERS))}; "
                "use the producer_config 'partitioner' of the sinks writing the topic"
            )
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        if threads < 1:
            raise ConfigError(f"threads must be at least 1, got {threads}")
        self._topic = resolve_topic(run_id, topic)
        self._partitioner = partitioner
        self._timeout_s = timeout_s
        self._context = ClientContext(bootstrap_servers, dict(consumer_config or {}))
        self._end_request = Request(f"read the end of {self._topic!r}", timeout_s)
        self._read_request = Request(f"read {self._topic!r}", timeout_s)
        self._watch = AuthenticationWatch(self._context)
        self._consumer: Consumer = self._open_reader()
        # A second handle asks the broker questions (metadata, offsets): a request on the reading handle waits
        # behind another thread's consume call (measured: seconds, past its own timeout), one here does not.
        self._asker: Consumer = self._open_reader()
        self._unassigned: dict[int, int] = {}
        """Partitions to start reading, at their first offset; the reader assigns them, as the consumer is used
        by one thread at a time."""
        self._lock = threading.Lock()
        """Guards the folded state; never held while waiting on the broker."""
        self._read = threading.Condition(self._lock)
        """Notified whenever the reader has folded what it read (or given up reading)."""
        self._reading = False
        """True while one caller reads for every waiting caller; the consumer is never read from two threads."""
        self._partitions: int | None = None
        self._next: dict[int, int] = {}
        self._assigning: defaultdict[int, threading.Lock] = defaultdict(threading.Lock)
        self._ends = _SharedQuestion()
        self._rollouts: dict[str, _RolloutLog] = {}
        self._parents = KeptParents(max_kept_tokens)
        """Each rollout's last materialized parent, kept with the log it was read from."""
        self._chunk_router = InboundRouter(topic=self._topic)
        """Reassembles chunk groups, the one way every reader does, by the topic's limits (read before the first
        partition is assigned)."""
        self._limits: TopicLimits | None = None
        # Restoring is CPU work on one rollout; striped by rollout so concurrent calls do not queue on one lock,
        # with the kept tokens still bounded overall.
        self._restorers = [
            (threading.Lock(), ParentRestorer(max_tokens=DEFAULT_KEPT_TOKENS // _RESTORE_STRIPES))
            for _ in range(_RESTORE_STRIPES)
        ]
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokcap-lineage")
        self._ledger: KafkaCaptureLedger | None = None
        self._ledger_lock = threading.Lock()
        self._ledger_settings: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers,
            "store_dir": store_dir,
            "topic": self._topic,
            "delivery_timeout_s": delivery_timeout_s,
            "producer_config": producer_config,
            "consumer_config": consumer_config,
        }
        self._closed = False
        if store_dir is not None:
            self._capture_ledger()

    def __repr__(self) -> str:
        """Names the topic only: consumer settings may hold credentials."""
        return f"KafkaLineageResolver(topic={self._topic!r})"

    def _open_reader(self) -> Consumer:
        """A private reader; it starts at the offsets it asked the broker for (``earliest`` only covers a start
        that retention removed between the question and the fetch)."""
        return open_reader(
            self._context,
            self._topic,
            purpose="lineage",
            watch=self._watch,
            timeout_s=self._timeout_s,
            reset="earliest",
            defaults={"fetch.wait.max.ms": 10},
        )

    @property
    def topic(self) -> str:
        """The run topic this resolver reads."""
        return self._topic

    @source_timed("kafka", "resolve")
    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> LineageResolution:
        """Return ROOT, RESOLVED with the proven parent's cumulative tokens, or UNRESOLVED with a reason."""
        fingerprint = assistant_fingerprint(request_items)
        if not fingerprint:
            return LineageResolution(ParentResolutionStatus.ROOT)
        # Its own threads: a call mostly waits on the broker, and the default pool (a few threads) would queue
        # concurrent rollouts' calls behind each other.
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._resolve_continuation, rollout_id, request_items, fingerprint
        )

    def resolve_now(self, rollout_id: str, request_items: Sequence[Any]) -> LineageResolution:
        """The blocking form of ``resolve``."""
        fingerprint = assistant_fingerprint(request_items)
        if not fingerprint:
            return LineageResolution(ParentResolutionStatus.ROOT)
        return self._resolve_continuation(rollout_id, request_items, fingerprint)

    def _resolve_continuation(
        self, rollout_id: str, request_items: Sequence[Any], fingerprint: str
    ) -> LineageResolution:
        """Read the rollout's partition up to its end as of now, then decide; the request has a model turn."""
        with self._lock:
            self._raise_if_closed()
            partition = self._partition_of(rollout_id)
        self._assign(partition)
        # The end is asked outside the lock, and concurrent calls share one question for all their partitions.
        high = self._ends.ask(partition, self._ends_of)
        self._catch_up(partition, high)
        answer = self._answer(rollout_id, request_items, fingerprint)
        if answer.status is not ParentResolutionStatus.UNRESOLVED:
            return answer
        with self._lock:
            log = self._rollouts.get(rollout_id)
            ledger_rows = log is not None and log.ledger_rows
        if self._ledger is not None or ledger_rows:
            # Engine-side staging: the parent is a ledger row, not a put.
            staged = self._capture_ledger().staged_resolution(rollout_id, request_items)
            if staged is not None:
                return staged
        return answer

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise TransportError(f"{self!r} is closed; build a new resolver")

    def _answer(
        self, rollout_id: str, request_items: Sequence[Any], fingerprint: str | None = None
    ) -> LineageResolution:
        """The decision over what has been read of the log so far."""
        with self._lock:
            log = self._rollouts.get(rollout_id) or _RolloutLog.of(rollout_id)
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

    def is_process_shared(self) -> bool:
        """True: every worker reads the same topic."""
        return True

    def _capture_ledger(self) -> KafkaCaptureLedger:
        """The ledger, started on first use (it starts a materializer: call it off the event loop)."""
        with self._ledger_lock:
            self._raise_if_closed()
            if self._ledger is None:
                self._ledger = KafkaCaptureLedger(**self._ledger_settings)
            return self._ledger

    async def _started_ledger(self) -> KafkaCaptureLedger:
        ledger = self._ledger
        return ledger if ledger is not None else await asyncio.to_thread(self._capture_ledger)

    async def record(self, commit: Any) -> None:
        """Gym's ``CaptureLedger.record``: returns once every serving worker can read the row."""
        await (await self._started_ledger()).record(commit)

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Gym's ``CaptureLedger.record_failure``: the row poisons the rollout and never resolves a parent."""
        await (await self._started_ledger()).record_failure(rollout_id, model_call_id, reason)

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        """Gym's ``CaptureLedger.manifest``, as plain JSON."""
        return await (await self._started_ledger()).manifest(rollout_id)

    async def has_rows(self, rollout_id: str) -> bool:
        """Gym's ``CaptureLedger.has_rows``; failure rows count."""
        return await (await self._started_ledger()).has_rows(rollout_id)

    async def pending_rollouts(self) -> list[PendingRollout]:
        """The rollouts with committed rows, not retired or deleted, each saying if it has failure rows."""
        return await (await self._started_ledger()).pending_rollouts()

    async def retire(self, rollout_ids: Sequence[str]) -> dict[str, list[str]]:
        """Gym main's ``CaptureLedger.retire``: remove the rollouts' rows and keep their fences."""
        return await (await self._started_ledger()).retire(rollout_ids)

    async def delete(self, rollout_ids: Sequence[str]) -> dict[str, list[str]]:
        """Gym main's ``CaptureLedger.delete``: remove the rollouts and their fences."""
        return await (await self._started_ledger()).delete(rollout_ids)

    async def close(self) -> None:
        """Close the consumer (and the ledger's clients); calling it again is a no-op."""
        with self._ledger_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            ledger = self._ledger
        if ledger is not None:
            await ledger.close()
        with self._lock:
            self._rollouts.clear()
            self._chunk_router = InboundRouter(topic=self._topic, limits=self._chunk_router.limits)
            self._parents.clear()
            self._read.notify_all()
        await asyncio.to_thread(self._stop_reading)
        await asyncio.to_thread(self._consumer.close)
        await asyncio.to_thread(self._asker.close)
        self._executor.shutdown(wait=False)

    def _stop_reading(self) -> None:
        """Wait for a read in progress (at most one short consume) to end: the consumer is closed after it."""
        with self._read:
            while self._reading:
                self._read.wait()

    # ------------------------------------------------------------------ reading the log

    def _partition_of(self, rollout_id: str) -> int:
        if self._partitions is None:
            self._partitions = partition_count(
                self._asker, self._watch, self._context, self._timeout_s, self._topic
            )
        return partition_of_rollout(rollout_id, self._partitions, self._partitioner)

    def _assign(self, partition: int) -> None:
        """Start reading the partition from its first held offset, once; other partitions' calls go on meanwhile."""
        with self._lock:
            if partition in self._next:
                return
            assigning = self._assigning[partition]
        with assigning:
            with self._lock:
                if partition in self._next:
                    return
            if self._limits is None:
                limits = read_topic_limits(
                    self._context, self._topic, watch=self._watch, timeout_s=self._timeout_s
                )
            where = TopicPartition(self._topic, partition)
            with translated(self._context, self._end_request):
                low, _ = self._asker.get_watermark_offsets(where, timeout=self._timeout_s, cached=False)
            with self._lock:
                self._raise_if_closed()
                if self._limits is None:
                    self._limits = self._chunk_router.limits = limits
                self._next[partition] = int(low)
                self._unassigned[partition] = int(low)

    def _ends_of(self, partitions: frozenset[int]) -> dict[int, int]:
        """Each partition's offset after its last message, asked of the broker now in one request.

        Asked with the consumer's own settings, so under ``isolation.level=read_committed`` (the default) it is
        the last stable offset: the end that reading can reach (the high watermark when nothing is transactional).
        """
        wanted = [TopicPartition(self._topic, partition, OFFSET_END) for partition in sorted(partitions)]
        ends: dict[int, int] = {}
        with translated(self._context, self._end_request):
            for where in self._asker.offsets_for_times(wanted, timeout=self._timeout_s):
                if where.error is not None:
                    raise KafkaException(where.error)
                ends[where.partition] = int(where.offset)
        return ends

    def _catch_up(self, partition: int, high: int) -> None:
        """Wait until the partition is read up to ``high``, its end as of the call.

        One caller at a time reads, without the lock, for every waiting caller; the others wait until what
        it read is folded. A caller whose partition is read returns at once, whatever the others wait for.
        """
        deadline = time.monotonic() + self._timeout_s
        with self._read:
            while self._next[partition] < high:
                self._raise_if_closed()
                self._watch.raise_if_failed()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(
                        f"could not read partition {partition} of {self._topic!r} up to offset {high} within "
                        f"{self._timeout_s:g} s (at {self._next[partition]}); is the broker reachable?"
                    )
                if self._reading:
                    self._read.wait(remaining)
                    continue
                self._reading = True
                try:
                    self._read_once(min(remaining, 0.1))
                finally:
                    self._reading = False
                    self._read.notify_all()

    def _read_once(self, timeout_s: float) -> None:
        """Read what the consumer has (waiting up to ``timeout_s`` for one message) and fold it; lock held."""
        unassigned, self._unassigned = self._unassigned, {}
        messages: list[Message] = []
        self._lock.release()
        try:
            if unassigned:
                # The handle learns the new partitions' leaders before the first fetch (the first resolves of
                # a run stalled 0.5-1 s without).
                assign_reader(
                    self._consumer,
                    self._context,
                    self._watch,
                    self._topic,
                    unassigned,
                    self._timeout_s,
                    incremental=True,
                )
                unassigned = {}
            with translated(self._context, self._read_request):
                messages = self._consumer.consume(1, timeout_s)
                if messages:
                    messages.extend(self._consumer.consume(500, 0))
        finally:
            self._lock.acquire()
            self._unassigned.update(unassigned)  # not assigned: the next reader tries again
        # Every message is folded before a failure is raised: the consumer will not hand them out again.
        # A few at a time, letting the callers already read answer in between rather than after the batch.
        failure: TransportError | None = None
        for start in range(0, len(messages), _FOLD_STEP):
            if start:
                self._read.notify_all()
                self._lock.release()
                time.sleep(0)  # yields the GIL to the callers just woken
                self._lock.acquire()
            for message in messages[start : start + _FOLD_STEP]:
                failure = self._take(message) or failure
        if failure is not None:
            raise failure

    def _take(self, message: Message) -> TransportError | None:
        error = message.error()
        if error is not None:
            return read_failure(error, self._context, self._topic)
        partition, offset = message.partition(), message.offset()
        if partition is None or offset is None or offset < self._next.get(partition, 0):
            return None
        self._next[partition] = offset + 1
        rollout_id = rollout_of_key(message.key())
        value = message.value()
        if rollout_id is None or value is None:
            return None
        try:
            headers = headers_to_dict(message.headers())
            if read_chunk_header(headers) is not None:
                if headers.get(HEADER_TYPE) == "put":
                    self._take_chunk(LogMessage.of(message))
                else:
                    # A large stage (media, routed experts) is no candidate: its bytes are counted, not kept.
                    self._chunk_router.pass_over(LogMessage.of(message))
                return None
            self._fold(rollout_id, value, headers, partition, offset)
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
        return None

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
                self._fold(event.rollout_id, value, headers, decided.partition, -1, position)
            elif isinstance(decided, DeadLetter) and decided.mask is not None:
                self._log_of(decided.mask.rollout_id).keep(decided.position(self._topic), decided.mask)

    def _log_of(self, rollout_id: str) -> _RolloutLog:
        """The rollout's log, begun empty the first time one of its events is read."""
        log = self._rollouts.get(rollout_id)
        if log is None:
            log = self._rollouts[rollout_id] = _RolloutLog.of(rollout_id)
        return log

    def _mask(self, rollout_id: str, position: LogPosition, why: str) -> None:
        """Keep the mask the materializer applies for an event it dead-letters, for the rules to decide."""
        reason = f"dead-lettered event at {why}"[:REASON_LIMIT]
        mask = IncompleteEvent(rollout_id=rollout_id, writer=LOG_READER_WRITER, reason=reason)
        self._log_of(rollout_id).keep(position, mask)

    def _fold(
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

    def _decide(self, log: _RolloutLog, command: Event, position: LogPosition | None) -> None:
        """Decide a lifecycle command by the rules, over every event of the rollout read before it.

        The verdicts are the materializer's: a drop retires only the snapshot and version frozen, a retire
        always, a delete starts the rollout afresh; a retired rollout's calls are forgotten.
        """
        rollout_id = log.state.rollout_id
        state = log.state
        for at, item in log.undecided:
            event = item if not isinstance(item, _StoredPut) else self._put_or_mask(log, item, at)
            state = decide(state, event, at).state
        log.undecided.clear()
        # A command handed over without a position (never by the consumer) names its snapshot by the topic.
        state = decide(state, command, position, new_snapshot_id=f"{self._topic}:unpositioned").state
        if isinstance(command, DeleteEvent):
            self._rollouts.pop(rollout_id, None)
            self._parents.forget(rollout_id)
        elif state.retired:
            self._rollouts[rollout_id] = _RolloutLog(state)
            self._parents.forget(rollout_id)
        else:
            log.state = state

    def _put_or_mask(self, log: _RolloutLog, stored: _StoredPut, position: LogPosition | None) -> Event:
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
        log: _RolloutLog,
        rollout_id: str,
        value: bytes,
        headers: dict[str, str],
        partition: int,
        offset: int,
    ) -> _StoredPut:
        """Keep a put as read and, while its rollout is open and its head proves a call, index it as a candidate."""
        stored = _StoredPut(value, headers, rollout_id.encode(), partition, offset)
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

    def _restored(self, log: _RolloutLog, stored: _StoredPut) -> PutEvent:
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

    def _entry_of(self, log: _RolloutLog, call_id: str) -> TokenEntry:
        stored = log.puts.get(call_id)
        if stored is None:
            raise LineageLookupError(f"call {call_id} is indexed but its record was not kept")
        return self._put_of(log, stored).entry

    def _put_of(self, log: _RolloutLog, stored: _StoredPut) -> PutEvent:
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

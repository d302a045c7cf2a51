"""The materializer: applies the run topic's events to a local file store, in log order per rollout.

It reads each assigned partition from its own checkpoint in the store directory (``checkpoint``),
not from consumer-group offsets, routes every message through the inbound router (``router``) and
applies what it decides, with the event's log position, through the directory's single-writer projection
(``tokcap.log_projection``: hot state in memory, flushed in blocks before each checkpoint). This module
holds that loop: consumer I/O, checkpoints and lifecycle. The scheduler (``schedule``) decides which routed
decision to carry out next; the waiter registry (``waiters``) holds the sources' waits on positions.

Exactly-once argument, per partition:

- The checkpoint holds ``next_offset`` (every offset below it was processed) and the offsets of the
  chunks of still-open chunk groups. It is replaced atomically after each applied batch.
- On start, reading resumes at the smallest of those; below ``next_offset`` only the listed chunk
  offsets are taken (to rebuild the open groups) and everything else is skipped, so nothing is applied twice.
- Events at or after ``next_offset`` may have been applied just before a crash; the store skips an
  event at or before its rollout's last applied position, and a rollout deleted in that window is
  rebuilt and deleted again by the same events, so the end state is the same.
- Dead-letter lines are deduplicated by offset and written in processing order, so a resumed run
  writes exactly the lines a clean run writes.

Commands first (a freeze never waits behind other rollouts' backlog):

- The loop reads ahead of what it applied (bounded by ``READ_AHEAD_MESSAGES`` and ``READ_AHEAD_BYTES``) and
  routes every message in log order, so the router's chunk state is exactly a clean run's.
- Routing a capture message (intent, cancel, put, incomplete) reads only its headers and key; it is decoded
  when its own rollout needs it (its apply, or an in-process source's freeze), in that rollout's log order.
  So reading ahead of a backlog costs a few microseconds a message, and a freeze is read without first
  decoding every other rollout's puts before it.
- Routing decisions are then carried out per rollout in log order (``schedule`` keeps that order and the
  low-water mark below), but not across rollouts: when the read-ahead holds a source command (freeze, drop,
  retire, delete), that rollout's decisions up to the command are carried out first. A rollout's files
  depend only on its own events and their positions, so every rollout's files end as a clean in-order
  replay leaves them.
- The checkpoint stays the low-water mark: ``next_offset`` is the first message with a decision not yet
  carried out, and its open chunk offsets are the router's as of that message. Every rollout has applied a
  prefix of its own events, so on resume the store skips exactly the ones at or before its recorded position.
- Dead-letter lines are still written when the in-order sweep reaches them, so their order is a clean run's.

An event that cannot be decoded, has an unknown type or a newer schema, or a chunk group that can
never complete, goes to the partition's dead-letter log (``dead_letters``) with its partition, offset and
reason; where the key is a valid rollout id that rollout is marked incomplete. Consumption never stalls on one.

Offsets are never skipped. The directory is bound to one incarnation of the topic (its id, ``incarnation``):
records of another one are refused before anything is applied, and the id is read again while running and
before any command read is answered; a changed id stops the loop with ``TopicIncarnationError``. Each
partition's fetched offsets must follow one another from the resume offset: an offset past the expected one
(events deleted before they were read) stops the loop with ``OffsetGapError``, and one before it (the log
rewritten under the same id) with ``MaterializerFailedError``.

Run it in a thread (``start``/``stop``) or as a process::

    python -m transports.kafka.materializer --bootstrap HOST:PORT --topic TOPIC --dir STORE_DIR [--metrics-port PORT]

With ``--metrics-port`` it serves ``/metrics`` and ``/healthz`` as ``tokcap materialize`` does (``readiness``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import signal
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from filelock import FileLock, Timeout

from tokcap.durable_io import remove_stale_temp_files
from tokcap.errors import ConfigError, InvalidInputError, TokcapError, TransportError
from tokcap.events import EventType, FreezeEvent
from tokcap.log_projection import Projection
from tokcap.metrics import LoopStatus, PartitionStatus, watch_loop
from tokcap.metrics_http import DEFAULT_METRICS_HOST
from tokcap.protocols import TokenCaptureSnapshot
from tokcap.store import ApplyResult, TokenCaptureStore
from transports.kafka.client.admin import TopicIdReader
from transports.kafka.client.clients import (
    AuthenticationWatch,
    ClientContext,
    assign_reader,
    list_topics,
    open_reader,
)
from transports.kafka.client.error_map import read_failure
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.client.offset_reader import OffsetReader
from transports.kafka.client.topics import validate_topic_name
from transports.kafka.errors import (
    BrokerAuthenticationError,
    BrokerAuthorizationError,
    MaterializerFailedError,
    MaterializerOwnedElsewhereError,
    OffsetGapError,
    TopicLimitsMismatchError,
)
from transports.kafka.materializer.apply import carry_out, refused_staging_reason
from transports.kafka.materializer.checkpoint import (
    CHECKPOINT_PREFIX,
    PartitionCheckpoint,
    checkpoint_files,
    checkpoint_path,
    write_checkpoints,
)
from transports.kafka.materializer.dead_letters import (
    DEAD_LETTER_PREFIX,
    REASON_LIMIT,
    DeadLetterLine,
    DeadLetterLog,
)
from transports.kafka.materializer.incarnation import IncarnationWatch
from transports.kafka.materializer.loop_metrics import (
    count_applied,
    count_dead_letter,
    observe_command_wait,
    observe_flush,
    observe_freeze,
)
from transports.kafka.materializer.ownership import check_owner_records, write_owner_records
from transports.kafka.materializer.schedule import COMMANDS, MaterializerCounters, Read, Scheduler
from transports.kafka.materializer.waiters import WaiterRegistry
from transports.kafka.wire.codec import LogMessage, type_header
from transports.kafka.wire.delta_parents import ParentRestorer
from transports.kafka.wire.router import (
    MATERIALIZER_WRITER,
    ORPHAN_AFTER_OFFSETS,
    ApplyEvent,
    DeadLetter,
    Deferred,
    InboundRouter,
    Routed,
)
from transports.kafka.wire.topic_limits import TopicLimits, check_given, warn_given

# CHECKPOINT_PREFIX, DEAD_LETTER_PREFIX, MATERIALIZER_WRITER and ORPHAN_AFTER_OFFSETS live in their own
# modules now; they stay importable from here.
__all__ = [
    "CHECKPOINT_PREFIX",
    "DEAD_LETTER_PREFIX",
    "MATERIALIZER_WRITER",
    "ORPHAN_AFTER_OFFSETS",
    "OWNER_LOCK_PREFIX",
    "READ_AHEAD_BYTES",
    "READ_AHEAD_MESSAGES",
    "SWEEP_BLOCK_MESSAGES",
    "DeadLetterLog",
    "Materializer",
    "MaterializerCounters",
    "PartitionCheckpoint",
    "carry_out",
    "check_block_messages",
    "collect_less_after_start_up",
    "logger",
    "main",
    "remove_stale_temp_files",
]

logger = logging.getLogger(__name__)

OWNER_LOCK_PREFIX = "kafka-materializer-p"
"""Lock file held by the one materializer applying partition N into a directory: ``kafka-materializer-p<N>.lock``."""

READ_AHEAD_MESSAGES = 20_000
"""Most messages read and routed but not yet applied, over all partitions: how far ahead a command is seen."""

READ_AHEAD_BYTES = 16 * 1024 * 1024
"""Most wire bytes (keys and values) held read ahead; bounds the memory of a large backlog.

Decoded, an entry's token ids take about ten times their wire size (one Python int each), so this holds
on the order of 200 MB at most."""

SWEEP_BLOCK_MESSAGES = 1_000
"""Most messages the in-order sweep applies in one projection block, then one sync and a checkpoint.

Each rollout's state file is replaced once per block it has events in: a file create and a rename, the
largest cost of the apply step on ext4. Blocks of 1,000 messages instead of 200 cut the store's CPU per
event on the main workload by about a third (``python -m bench --only apply_cost --baseline DIR``). Nothing urgent
waits for a block to end: a command read meanwhile ends it at the next step, and in-process freezes are
carried out when read and answered from memory. A crash inside a block applies at most one block again."""

_SWEEP_STEP = 25
"""Most messages swept between two reads: how long an in-process source's freeze can sit unread behind the sweep."""

_SWEEP_STEP_S = 0.005
"""Longest a sweep step runs before the loop reads again, whatever it has swept.

Each message swept makes several system calls, and after each one the thread waits to take the GIL back
from whichever thread holds it. In a process whose other threads keep the CPU busy (a model server's event
loop, a trainer), 25 messages measured up to 460 ms, and every freeze read behind them waited that long.
"""

_SETTLE_STEP_S = 0.005
"""Time given to decoding messages read ahead (oldest first) between two steps of the sweep.

Reading defers decoding, so a freeze is read without waiting for other rollouts' puts to be decoded; with
time to spare the loop decodes them anyway, so a trainer's burst of freezes does not pay for its rollouts'
decoding all at once (a batch of 200 freezes spent about 0.7 s instead of 0.45 s of CPU without this).
"""

_DECODE_FIRST_TOKENS = 2_000_000
"""Most tokens decoded ahead of the sweep and not asked for yet while decoding goes first (about 70 MB).

In a process that also runs the load, the loop gets a share of one core. Sweeping first left the decoding
of a round's puts to the burst of freezes at its end: each answer decoded its rollout's puts first (about
2 ms of 3), one after another, and the last freeze of 64 waited for all of them. Decoding first moves that
work before the burst; past this bound the sweep goes first again, so memory stays bounded when the loop
falls far behind (a replay answers no source and never decodes first).
"""

_UNKNOWN_TOPIC_WAIT_S = 5.0
"""How long a materializer starting on a topic its broker does not know yet asks again before failing."""

_METADATA_TIMEOUT_S = 30.0
"""How long a metadata request may wait for the broker; a refused login ends it within a second."""

_ID_READ_TIMEOUT_S = 3.0
"""How long one read of the topic's id may wait; a failed read is tried again with a new admin client."""

_READ_STEP = 1_000
"""Messages read and routed per loop turn, so a burst does not delay the apply of commands already read."""

_COMMAND_BUDGET = 100
"""Decisions carried out for commands in a first block before their sources are answered."""

_COMMAND_BUDGET_MOST = 3_200
"""The largest block of a burst of commands: each block of a burst doubles, up to this."""

_ANSWERS_KEPT = 1_000
"""Freezes answered from memory and not taken yet; a source that finds its answer forgotten reads the files."""

_POLL_TIMEOUT_S = 0.2
_RESULTS_KEPT = 10_000


@dataclass
class _PartitionProgress:
    """Runtime state of one partition: its checkpoint, dead letters and replay window (the scheduler holds its
    read-ahead)."""

    checkpoint: PartitionCheckpoint
    dead_letters: DeadLetterLog
    replay_below: int
    replay_chunks: set[int]
    """Chunk offsets of the checkpoint's open groups that have not been read again yet."""
    written: bytes
    fetch_next: int
    """The offset the next fetched message must have: reading goes on from the resume offset without a gap."""
    refused: dict[int, str] = field(default_factory=dict)
    """Offsets of applied staging events the store refused, with the reason their dead-letter line gives."""


def check_block_messages(block_messages: object) -> int:
    """A durable block bound, refused unless it is a positive whole number of messages."""
    if isinstance(block_messages, bool) or not isinstance(block_messages, int) or block_messages < 1:
        raise InvalidInputError(
            f"block_messages must be a positive number of messages, got {block_messages!r}"
        )
    return block_messages


class Materializer:
    """Consumes a run topic and projects it into a ``TokenCaptureStore`` directory."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        store_dir: str | Path,
        partitions: Sequence[int] | None = None,
        *,
        consumer_config: Mapping[str, Any] | None = None,
        consumer_factory: Callable[[dict[str, Any]], Consumer] = Consumer,
        on_dead_letter: Callable[[DeadLetterLine], object] | None = None,
        block_messages: int | None = None,
        topic_id_reader: Callable[[], str] | None = None,
        limits_reader: Callable[[], TopicLimits] | None = None,
        max_event_bytes: int | None = None,
        max_open_chunk_bytes: int | None = None,
        skipped_types: frozenset[str] = frozenset(),
    ) -> None:
        """``consumer_factory`` builds the consumer from its settings; tests pass an in-memory topic double.

        ``topic_id_reader`` returns the topic's id now (``TopicIdReader`` by default; a test double passes its
        own): the directory is bound to that incarnation of the topic.

        ``on_dead_letter`` is called, on the materializer's thread, with each dead-letter line once it is
        written (``tokcap materialize`` prints them); it must not block.

        ``block_messages`` bounds the in-order sweep's projection blocks: smaller blocks checkpoint
        more often (a resume applies less again), larger ones write each rollout's state fewer times; the
        default is ``SWEEP_BLOCK_MESSAGES``.

        The topic's limits (``topic_limits``) bound the memory of large events being reassembled (``router``):
        a larger chunk group is dead-lettered and its rollout masked. They are read from the topic when the
        materializer starts (``limits_reader``, ``read_topic_limits`` over the consumer factory by default).
        ``max_event_bytes`` and ``max_open_chunk_bytes`` are deprecated: given, they are only checked against
        the topic's (``TopicLimitsMismatchError`` at start when they differ).

        ``skipped_types`` names event types (``type`` headers) this projection passes over unread: their
        messages are neither decoded nor applied, and their chunks are counted towards the memory limits but
        not kept, as the lineage resolver passes over other rollouts' groups. A ledger-only projection skips
        ``stage``, so its start-up time and disk do not grow with the tokens staged on the topic. Such a
        projection is partial by design: it starts from an empty directory only, and nothing else may read
        or resume it.
        """
        self._block_messages = check_block_messages(
            SWEEP_BLOCK_MESSAGES if block_messages is None else block_messages
        )
        self._bootstrap = bootstrap_servers
        self._on_dead_letter = on_dead_letter
        self._new_consumer = consumer_factory
        self._topic = validate_topic_name(topic)
        self._skipped_types = frozenset(skipped_types)
        if self._skipped_types and checkpoint_files(Path(store_dir)):
            raise ConfigError(
                f"{store_dir} holds checkpoints already; a projection that skips {sorted(self._skipped_types)} "
                "events starts from an empty directory only"
            )
        self._store = TokenCaptureStore(store_dir)
        self._requested_partitions = None if partitions is None else sorted(set(partitions))
        self._consumer_config = dict(consumer_config or {})
        self._client = ClientContext(bootstrap_servers, self._consumer_config)
        self._watch = AuthenticationWatch(self._client)
        self._read_topic_id = topic_id_reader or TopicIdReader(
            bootstrap_servers, self._topic, client_config=self._consumer_config, timeout_s=_ID_READ_TIMEOUT_S
        )
        self._incarnation: IncarnationWatch | None = None
        self._read_limits = limits_reader or (
            lambda: read_topic_limits(
                self._client,
                self._topic,
                watch=self._watch,
                factory=self._new_consumer,
                timeout_s=_ID_READ_TIMEOUT_S,
            )
        )
        self._given_limits = {
            "max_event_bytes": max_event_bytes,
            "max_open_chunk_bytes": max_open_chunk_bytes,
        }
        if max_event_bytes is not None or max_open_chunk_bytes is not None:
            warn_given("Materializer", self._given_limits)
        self._fetched_at = 0.0
        """When the batch being routed was fetched (``time.monotonic``)."""
        self._progress: dict[int, _PartitionProgress] = {}
        # Wire deltas whose parent the router no longer keeps (a resume past it) read it again from the log.
        self._parent_reader = OffsetReader(
            self._client, self._topic, purpose="materializer", watch=self._watch, factory=self._new_consumer
        )
        self._router = InboundRouter(topic=self._topic, parents=ParentRestorer(self._parent_reader.read))
        self._applied_next: dict[int, int] = {}
        self._applied_ahead: dict[int, set[int]] = {}
        self._schedule = Scheduler(
            time.monotonic, first_command_block=_COMMAND_BUDGET, most_command_block=_COMMAND_BUDGET_MOST
        )
        self._counters = self._schedule.counters
        self._results: OrderedDict[tuple[int, int], ApplyResult] = OrderedDict()
        self._projection = Projection(self._store)
        """The store's hot rollouts in memory: what the loop applies goes through it, and freezes are answered
        from it before their block is flushed."""
        self._answers: OrderedDict[tuple[int, int], tuple[ApplyResult, TokenCaptureSnapshot]] = OrderedDict()
        """Freezes of in-process sources answered from memory, by position: the verdict and snapshot, taken once."""
        self._unanswered: list[tuple[EventType, float]] = []
        """Commands carried out since the last checkpoint and not answered from memory: their type and when
        they were read. Their answer is the checkpoint that makes them durable."""
        self._answered_writers: Counter[str] = Counter()
        """Writer ids of the in-process sources whose freezes are answered from memory as soon as applied."""
        self._waiters = WaiterRegistry(self._is_applied, self._is_answered)
        self._condition = self._waiters.condition
        """Guards what the waits read (applied offsets, answers from memory) and what other threads read."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._consumer: Consumer | None = None
        """The loop's consumer while it owns its partitions: a scrape reads its cached end offsets."""
        self._consumer_lock = threading.Lock()
        self._checkpoint_moved: dict[int, float] = {}
        """Per partition, when its checkpoint last moved forward (``time.monotonic``)."""
        watch_loop(self)

    # ---------------------------------------------------------------- public

    @property
    def store(self) -> TokenCaptureStore:
        """The store this materializer writes."""
        return self._store

    @property
    def topic(self) -> str:
        """The topic this materializer reads."""
        return self._topic

    @property
    def skipped_types(self) -> frozenset[str]:
        """The event types this materializer passes over without applying them."""
        return self._skipped_types

    @property
    def block_messages(self) -> int:
        """The most messages the in-order sweep applies per durable block."""
        return self._block_messages

    def start(self) -> None:
        """Run in a background thread until ``stop``; returns once partitions are assigned."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run_guarded, name=f"tokcap-materializer-{self._topic}", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        self._raise_if_failed()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the current batch, write its checkpoint and stop; idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)

    def run_until_stopped(self) -> None:
        """Run in the calling thread until ``request_stop`` (or a signal handler calling it)."""
        self._run_guarded()
        self._raise_if_failed()

    def request_stop(self) -> None:
        """Ask the loop to stop after its current batch; safe from a signal handler."""
        self._stop.set()

    def applied_offsets(self) -> dict[int, int]:
        """Per partition, the next offset to apply: every offset below it is applied and checkpointed."""
        with self._condition:
            return dict(self._applied_next)

    def result_at(self, partition: int, offset: int) -> ApplyResult | None:
        """The apply result of a recent event at this position (or of a freeze answered from memory), if remembered."""
        with self._condition:
            result = self._results.get((partition, offset))
            if result is None and (partition, offset) in self._answers:
                result = self._answers[(partition, offset)][0]
            return result

    def answer_freezes_for(self, writer: str) -> None:
        """Carry this writer's freezes out as soon as they are read and answer them from memory.

        Each freeze is applied right away, after its own rollout's earlier events only, and answered from the
        projection's state before its block is flushed (``tokcap.log_projection`` says why that is safe). An
        in-process source registers its writer id, then takes each answer with ``take_answer``. Freezes of
        other writers (sources in other processes read the files once the checkpoint passes them) wait for
        their turn.
        """
        with self._condition:
            self._answered_writers[writer] += 1

    def stop_answering_for(self, writer: str) -> None:
        """Undo one ``answer_freezes_for``; the writer's later freezes wait for their checkpoint."""
        with self._condition:
            self._answered_writers[writer] -= 1
            if self._answered_writers[writer] <= 0:
                del self._answered_writers[writer]

    def take_answer(self, partition: int, offset: int) -> TokenCaptureSnapshot | None:
        """The snapshot of the freeze at this position if it was answered from memory; given out once.

        It is the snapshot ``store.snapshot(rollout_id, as_of=...)`` returns once its block is flushed.
        """
        with self._condition:
            answer = self._answers.pop((partition, offset), None)
        return None if answer is None else answer[1]

    def counters(self) -> MaterializerCounters:
        """A copy of the loop's counters."""
        with self._condition:
            return MaterializerCounters(**self._counters.__dict__)

    def loop_status(self) -> LoopStatus:
        """Where the loop stands now, read from another thread (a metrics scrape, a health check)."""
        now = time.monotonic()
        with self._consumer_lock:
            consumer = self._consumer
            ends = {p: _cached_end(consumer, self._topic, p) for p in self._progress} if consumer else {}
        with self._condition:
            applied = dict(self._applied_next)
            failed = self._waiters.failure
            failure = None if failed is None else str(failed) or type(failed).__name__
        partitions = []
        for partition, progress in list(self._progress.items()):
            oldest = self._schedule.oldest_timestamp_ms(partition)
            partitions.append(
                PartitionStatus(
                    topic=self._topic,
                    partition=partition,
                    applied_next=applied.get(partition, progress.checkpoint.next_offset),
                    high_watermark=ends.get(partition),
                    oldest_unapplied_age_s=0.0 if oldest is None else max(0.0, time.time() - oldest / 1000),
                    checkpoint_age_s=now - self._checkpoint_moved.get(partition, now),
                )
            )
        return LoopStatus(
            topic=self._topic,
            running=consumer is not None and failure is None,
            failure=failure,
            partitions=partitions,
            rollouts_held=self._schedule.rollouts_held(),
            messages_held=self._schedule.held_messages,
            kept_tokens=self._projection.kept_tokens,
        )

    def _is_applied(self, partition: int, offset: int, command: bool) -> bool:
        """Whether this offset and everything before it (for a command: its rollout's events before it) is
        applied and durable; the caller holds the condition."""
        if self._applied_next.get(partition, 0) > offset:
            return True
        return command and offset in self._applied_ahead.get(partition, ())

    def _is_answered(self, partition: int, offset: int) -> bool:
        """Whether the freeze at this position was answered from memory; the caller holds the condition."""
        return (partition, offset) in self._answers

    def wait_for(self, partition: int, offset: int, timeout_s: float) -> bool:
        """Block until every event up to this offset is applied; return ``False`` on timeout."""
        applied = self._waiters.wait(partition, offset, timeout_s)
        self._raise_if_failed()
        return applied

    async def applied(
        self, partition: int, offset: int, timeout_s: float, *, command: bool = False, ahead: bool = False
    ) -> bool:
        """Wait, without holding a thread, until every event up to this offset is applied; ``False`` on timeout.

        With ``command`` (the offset holds a freeze, drop, retire or delete), wait only until the command and
        its own rollout's earlier events are applied: the verdict depends on nothing else, and other rollouts'
        backlog before it may still be waiting. With ``ahead`` as well, a freeze answered from memory ahead of
        its block's flush (``take_answer``) is waited for no further. Many trainers' freezes wait at once; a blocking
        wait per freeze would queue them behind the event loop's few executor threads.
        """
        answered = await self._waiters.wait_async(partition, offset, timeout_s, command=command, ahead=ahead)
        if answered:
            self._raise_if_failed()
        return answered

    def high_watermarks(self, timeout_s: float = 10.0) -> dict[int, int]:
        """Per assigned partition, the offset after the last message currently in the log."""
        consumer = self._open_reader()
        try:
            partitions = self._partitions(consumer, timeout_s)
            return {
                p: int(consumer.get_watermark_offsets(TopicPartition(self._topic, p), timeout=timeout_s)[1])
                for p in partitions
            }
        finally:
            consumer.close()

    def wait_until_caught_up(self, timeout_s: float = 60.0) -> bool:
        """Block until everything in the log at call time is applied; return ``False`` on timeout."""
        import time

        deadline = time.monotonic() + timeout_s
        for partition, high in self.high_watermarks().items():
            if high == 0:
                continue
            if not self.wait_for(partition, high - 1, max(0.0, deadline - time.monotonic())):
                return False
        return True

    # --------------------------------------------------------------- the loop

    def _open_reader(self) -> Consumer:
        """A private reader of the topic, assigned its partitions once their checkpoints are read."""
        return open_reader(
            self._client,
            self._topic,
            purpose="materializer",
            watch=self._watch,
            defaults={"fetch.wait.max.ms": 100},
            factory=self._new_consumer,
        )

    def _partitions(self, consumer: Consumer, timeout_s: float = 30.0) -> list[int]:
        if self._requested_partitions is not None:
            return list(self._requested_partitions)
        # Right after a topic is created, a broker other than the controller may not know it yet (seen on a
        # 3-node cluster): an unknown topic is asked about again for a few seconds before it is reported.
        deadline = time.monotonic() + _UNKNOWN_TOPIC_WAIT_S
        while True:
            metadata = list_topics(consumer, self._watch, self._client, timeout_s, self._topic).topics.get(
                self._topic
            )
            if metadata is not None and metadata.error is None and metadata.partitions:
                return sorted(metadata.partitions)
            unknown = (
                metadata is None
                or metadata.error is None
                or (metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART)
            )
            if not unknown or time.monotonic() >= deadline or self._stop.is_set():
                raise MaterializerFailedError(
                    f"topic {self._topic!r} has no readable partitions ({metadata and metadata.error}); "
                    "create it first"
                )
            time.sleep(0.2)

    def _raise_if_failed(self) -> None:
        failure = self._waiters.failure
        if isinstance(failure, MaterializerOwnedElsewhereError | TopicLimitsMismatchError):
            raise failure
        if failure is not None:
            # A specific stop (another topic incarnation, an offset gap) keeps its class for the caller.
            kind = type(failure) if isinstance(failure, MaterializerFailedError) else None
            raise (kind or MaterializerFailedError)(
                f"the materializer of topic {self._topic!r} stopped: {failure}"
            ) from failure

    def _run_guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            if isinstance(exc, MaterializerOwnedElsewhereError):
                logger.info("%s", exc)
            else:
                logger.exception("materializer of topic %s failed", self._topic)
            self._waiters.fail(exc)
        finally:
            self._ready.set()

    def _run(self) -> None:
        consumer = self._open_reader()
        try:
            with ExitStack() as held:
                partitions = self._partitions(consumer)
                for partition in partitions:
                    held.enter_context(self._exclusive(partition))
                checkpoints = self._bind(partitions)
                remove_stale_temp_files(self._store.root)
                try:
                    self._consume(consumer, checkpoints)
                except BaseException as exc:
                    self._projection.abandon(exc)
                    raise
        finally:
            with self._consumer_lock:
                self._consumer = None
            if self._incarnation is not None:
                self._incarnation.stop()
            consumer.close()
            self._parent_reader.close()

    def _bind(self, partitions: list[int]) -> dict[int, PartitionCheckpoint]:
        """Bind the directory to the topic's current incarnation and read the checkpoints to resume from.

        Owner records and checkpoints of another incarnation are refused here, before anything is applied.
        Those without an id (written before records had one) are rewritten with it now.
        """
        topic_id = self._first_topic_id()
        self._router.limits = self._first_limits()
        root = self._store.root
        check_owner_records(root, self._topic, partitions, topic_id)
        checkpoints = {
            partition: PartitionCheckpoint.of_directory(root, self._topic, partition, topic_id)
            for partition in partitions
        }
        unbound: dict[int, bytes] = {}
        for partition, checkpoint in checkpoints.items():
            with contextlib.suppress(FileNotFoundError):
                if checkpoint_path(root, partition).read_bytes() != checkpoint.encode():
                    unbound[partition] = checkpoint.encode()
        if unbound:
            logger.info(
                "binding the checkpoints of partitions %s in %s to topic %s id %s",
                sorted(unbound),
                root,
                self._topic,
                topic_id,
            )
        write_checkpoints(root, unbound)
        write_owner_records(root, self._topic, partitions, topic_id)
        self._incarnation = IncarnationWatch(self._topic, topic_id, self._read_topic_id)
        return checkpoints

    def _first_topic_id(self) -> str:
        """The topic's id at start, asked again for a while when the broker does not answer in time."""
        deadline = time.monotonic() + _METADATA_TIMEOUT_S
        while True:
            try:
                return self._read_topic_id()
            except (BrokerAuthenticationError, BrokerAuthorizationError):
                raise
            except TransportError as exc:
                if time.monotonic() >= deadline or self._stop.is_set():
                    raise
                logger.warning("reading the id of topic %s again: %s", self._topic, exc)
                time.sleep(0.2)

    def _first_limits(self) -> TopicLimits:
        """The topic's limits at start, checked against any given to the constructor; asked again for a while."""
        deadline = time.monotonic() + _METADATA_TIMEOUT_S
        while True:
            try:
                limits = self._read_limits()
            except (BrokerAuthenticationError, BrokerAuthorizationError):
                raise
            except TransportError as exc:
                if time.monotonic() >= deadline or self._stop.is_set():
                    raise
                logger.warning("reading the limits of topic %s again: %s", self._topic, exc)
                time.sleep(0.2)
                continue
            check_given("Materializer", self._topic, limits, **self._given_limits)
            return limits

    @property
    def limits(self) -> TopicLimits:
        """The topic's limits this materializer reads by (the defaults until it has started)."""
        return self._router.limits

    def _exclusive(self, partition: int) -> FileLock:
        """Hold partition ownership of this directory: two materializers applying one partition would corrupt it."""
        lock = FileLock(self._store.root / f"{OWNER_LOCK_PREFIX}{partition}.lock", timeout=0)
        try:
            lock.acquire()
        except Timeout as exc:
            raise MaterializerOwnedElsewhereError(
                f"partition {partition} of {self._topic!r} is already being materialized into {self._store.root} "
                "by another process; stop it, or give this materializer other partitions or another directory"
            ) from exc
        return lock

    def _consume(self, consumer: Consumer, checkpoints: Mapping[int, PartitionCheckpoint]) -> None:
        assignment = []
        for partition, checkpoint in checkpoints.items():
            progress = _PartitionProgress(
                checkpoint=checkpoint,
                dead_letters=DeadLetterLog.of_directory(self._store.root, partition),
                replay_below=checkpoint.next_offset,
                replay_chunks=set(checkpoint.pending_chunk_offsets),
                written=checkpoint.encode(),
                fetch_next=checkpoint.resume_offset(),
            )
            self._progress[partition] = progress
            self._schedule.open(partition, checkpoint.next_offset)
            self._checkpoint_moved[partition] = time.monotonic()
            with self._condition:
                self._applied_next[partition] = checkpoint.next_offset
                self._applied_ahead[partition] = set()
            assignment.append(TopicPartition(self._topic, partition, checkpoint.resume_offset()))
        assert self._incarnation is not None
        self._incarnation.start()
        assign_reader(
            consumer,
            self._client,
            self._watch,
            self._topic,
            {tp.partition: tp.offset for tp in assignment},
            _METADATA_TIMEOUT_S,
        )
        logger.info(
            "materializer ready: topic %s, resuming at %s, blocks of up to %d messages",
            self._topic,
            {tp.partition: tp.offset for tp in assignment},
            self._block_messages,
        )
        with self._consumer_lock:
            self._consumer = consumer
        self._ready.set()
        while not self._stop.is_set():
            for message in self._read(consumer):
                self._take(message)
            # Commands first, in a block and a checkpoint of their own: their sources are answered before
            # the sweep of other rollouts' events. Each block shares one filesystem sync; the checkpoint is
            # written only after it is durable.
            if self._schedule.commands_waiting():
                self._carry_out_commands()
                self._checkpoint("commands")
                if self._schedule.command_block_done():
                    continue  # a burst: the sweep waits until it is answered
            self._schedule.end_burst()
            self._sweep_reading(consumer)
            self._checkpoint("sweep")

    def _sweep_reading(self, consumer: Consumer) -> None:
        """Sweep one batch in steps, reading (and answering in-process sources' freezes) between them.

        An in-process source's freeze is carried out as soon as it is read, so reading between steps keeps its wait
        to one step of the sweep rather than a whole batch; a command that must be carried out ends the batch.
        While an in-process source is answered from memory, what was read is decoded before any of it is swept
        (``_DECODE_FIRST_TOKENS`` bounds it): a burst of freezes then finds its rollouts decoded.
        """
        swept = 0
        while swept < self._block_messages:
            if self._decodes_first():
                self._router.settle_oldest(time.monotonic() + _SETTLE_STEP_S, _DECODE_FIRST_TOKENS)
                # Left undecoded: the deadline passed (read, then decode on), or the bound is reached (sweep).
                if (
                    not self._router.all_decoded()
                    and self._router.decoded_ahead_tokens < _DECODE_FIRST_TOKENS
                ):
                    for message in self._read(consumer):
                        self._take(message)
                    if self._schedule.commands_waiting():
                        return
                    continue
            step = self._sweep(min(_SWEEP_STEP, self._block_messages - swept), _SWEEP_STEP_S)
            swept += step
            if not self._schedule.held_messages:
                self._router.settle_oldest(0.0)  # everything is applied: let go of what it was
                return
            if not step:
                return
            for message in self._read(consumer):
                self._take(message)
            if self._schedule.commands_waiting():
                return
            self._router.settle_oldest(time.monotonic() + _SETTLE_STEP_S)

    def _read(self, consumer: Consumer) -> list[Message]:
        """The next messages to route, as many as the read-ahead has room for (none when it is full).

        Wait for one message only when nothing is left to apply; then take what is already fetched:
        consume(n, t) alone blocks until n messages or t, which would delay every freeze by up to t.
        """
        room = min(_READ_STEP, READ_AHEAD_MESSAGES - self._schedule.held_messages)
        if room <= 0 or self._schedule.held_bytes >= READ_AHEAD_BYTES:
            return []
        idle = self._schedule.held_messages == 0
        messages = list(consumer.consume(1, _POLL_TIMEOUT_S if idle else 0))
        self._watch.raise_if_failed()
        if messages and room > 1:
            messages.extend(consumer.consume(room - 1, 0))
        self._fetched_at = time.monotonic()
        # Checked after the fetch: what was fetched before a change seen now is not routed.
        assert self._incarnation is not None
        self._incarnation.raise_if_changed()
        return messages

    def _checkpoint(self, block: str) -> None:
        """Flush the projection's ``block`` (``commands`` or ``sweep``), then write every changed checkpoint
        atomically and tell waiters."""
        # A block is flushed (and synced) even when nothing was applied: besides durability, the sync between two
        # reads leaves the consumer free for a scrape's cached read of its ends, which back-to-back blocking
        # reads of an idle topic starved for over 5 s.
        flush_started = time.monotonic()
        self._projection.begin()
        self._projection.flush()
        observe_flush(block, time.monotonic() - flush_started)
        changed: dict[int, bytes] = {}
        for partition, progress in self._progress.items():
            head = self._schedule.low_water(partition)
            if head is not None:
                # The low-water mark: resume re-reads from the first message not fully carried out.
                progress.checkpoint.next_offset = head.offset
                open_chunks: Sequence[int] = head.chunks_before
            else:
                progress.checkpoint.next_offset = self._schedule.read_next(partition)
                open_chunks = self._router.open_chunk_offsets(partition)
            # Chunks of the checkpoint's open groups not re-read yet are still open: a batch that read none
            # of this partition must not forget them.
            progress.checkpoint.pending_chunk_offsets = sorted({*open_chunks, *progress.replay_chunks})
            next_offset = progress.checkpoint.next_offset
            progress.checkpoint.commands_applied = sorted(
                offset
                for offset in {*self._applied_ahead.get(partition, ()), *self._schedule.ahead(partition)}
                if offset >= next_offset
            )
            encoded = progress.checkpoint.encode()
            if encoded != progress.written:
                changed[partition] = encoded
                self._checkpoint_moved[partition] = time.monotonic()
        write_checkpoints(self._store.root, changed)
        with self._condition:
            for partition, progress in self._progress.items():
                progress.written = changed.get(partition, progress.written)
                applied_next = progress.checkpoint.next_offset
                self._applied_next[partition] = applied_next
                ahead = self._applied_ahead.setdefault(partition, set())
                ahead |= self._schedule.take_ahead(partition)
                ahead.difference_update([offset for offset in ahead if offset < applied_next])
            answered_at = time.monotonic()
            for event_type, read_at in self._unanswered:
                observe_command_wait(event_type, read_at, answered_at)
            self._unanswered.clear()
            self._waiters.applied_moved()

    def _take(self, message: Message) -> None:
        """Take one consumed message: an error, a replayed chunk, a skipped offset or a new message to route."""
        error = message.error()
        if error is not None:
            self._on_consumer_error(error)
            return
        partition, offset = int(message.partition() or 0), int(message.offset() or 0)
        progress = self._progress.get(partition)
        if progress is None:
            return
        if offset != progress.fetch_next:
            self._out_of_sequence(partition, progress.fetch_next, offset)
        progress.fetch_next = offset + 1
        if offset < progress.replay_below:
            # Processed before the checkpoint; only the chunks of groups open there are needed again.
            if offset in progress.replay_chunks:
                progress.replay_chunks.discard(offset)
                self._router.rebuffer(LogMessage.of(message))
            return
        log_message = LogMessage.of(message)
        chunks_before = tuple(self._router.open_chunk_offsets(partition))
        routed: list[Routed | Deferred]
        if self._skipped_types and type_header(log_message.headers) in self._skipped_types:
            routed = list(self._router.pass_over(log_message))
        else:
            routed = self._router.route_deferring(log_message)
        read = Read(
            offset,
            routed,
            [False] * len(routed),
            chunks_before,
            log_message.size,
            timestamp_ms=log_message.timestamp_ms,
            read_at=self._fetched_at,
        )
        for index in self._schedule.add(partition, read):
            # No source is answered from a topic created again: prove the incarnation first (one
            # request per batch read, however many commands it holds).
            assert self._incarnation is not None
            self._incarnation.confirm_since(self._fetched_at, self._stop)
            decision = routed[index]
            assert isinstance(decision, ApplyEvent)
            if isinstance(decision.event, FreezeEvent) and self._answers_for(decision.event.writer):
                progress = self._progress[partition]
                for step in self._schedule.command(partition, read, index):
                    self._apply(progress, self._settled(step.read, step.index), step.read)

    def _settled(self, read: Read, index: int) -> Routed:
        """The decision at ``read``/``index``, decoding it first (and its rollout's earlier ones) if deferred."""
        decision = read.routed[index]
        if isinstance(decision, Deferred):
            decision = self._router.settle(decision)
            read.routed[index] = decision
        return decision

    def _decodes_first(self) -> bool:
        """Whether to decode what was read before sweeping: a source here is answered at once, within the bound."""
        if self._router.decoded_ahead_tokens >= _DECODE_FIRST_TOKENS:
            return False
        with self._condition:
            return bool(self._answered_writers)

    def _answers_for(self, writer: str) -> bool:
        with self._condition:
            return writer in self._answered_writers

    def _answer(self, routed: ApplyEvent, result: ApplyResult, read_at: float) -> bool:
        """Answer an in-process source's freeze from the projection's memory, before its block is flushed.

        Whether it was answered (otherwise the source reads its answer once the checkpoint passes it).
        """
        event = routed.event
        if not isinstance(event, FreezeEvent) or not self._answers_for(event.writer):
            return False
        try:
            snapshot = self._projection.snapshot(event.rollout_id, routed.position(self._topic))
        except TokcapError as exc:
            # The source reads the same answer from the files once the checkpoint passes the freeze.
            logger.debug(
                "freeze at partition %d offset %d answered from the files: %s",
                routed.partition,
                routed.offset,
                exc,
            )
            return False
        with self._condition:
            self._answers[(routed.partition, routed.offset)] = (result, snapshot)
            while len(self._answers) > _ANSWERS_KEPT:
                self._answers.popitem(last=False)
            self._counters.freezes_answered_ahead += 1
            observe_command_wait(event.type, read_at, time.monotonic())
            self._waiters.answered(routed.partition, routed.offset)
        return True

    def _carry_out_commands(self) -> None:
        """Carry out a block of the commands read so far, each after its own rollout's earlier decisions only."""
        for step in self._schedule.commands():
            self._apply(self._progress[step.partition], self._settled(step.read, step.index), step.read)

    def _sweep(self, budget: int, step_s: float | None = None) -> int:
        """Finish up to ``budget`` messages in log order, starting none after ``step_s`` seconds but the first.

        Return how many were finished.
        """
        swept_before = self._counters.messages_swept
        for step in self._schedule.sweep(budget, step_s):
            progress = self._progress[step.partition]
            decision = self._settled(step.read, step.index)
            if step.carry:
                self._apply(progress, decision, step.read)
            self._record_dead_letter(progress, decision)
        return self._counters.messages_swept - swept_before

    def _on_consumer_error(self, error: KafkaError) -> None:
        failure = read_failure(error, self._client, self._topic)
        if failure is not None:
            # A topic deleted and created again shows first as an offset out of range: say so if it is.
            assert self._incarnation is not None
            self._incarnation.check_now()
            self._incarnation.raise_if_changed()
            raise failure

    def _out_of_sequence(self, partition: int, expected: int, offset: int) -> None:
        """Stop on a fetched offset that is not the next one: applying on would skip or repeat events."""
        assert self._incarnation is not None
        self._incarnation.check_now()
        self._incarnation.raise_if_changed()
        if offset > expected:
            raise OffsetGapError(
                f"partition {partition} of topic {self._topic!r} jumped from offset {expected} to {offset}: "
                f"offsets {expected}-{offset - 1} were deleted (by retention or delete-records) before this "
                f"materializer read them, so {self._store.root} cannot hold every event of the run. Replay a "
                "complete copy of the topic into a new directory; docs/operations.md says how to recover"
            )
        raise MaterializerFailedError(
            f"partition {partition} of topic {self._topic!r} went back from offset {expected} to {offset} "
            "under the same topic id: the log was truncated and rewritten (an unclean leader election?), so "
            f"{self._store.root} may hold events the topic no longer has. Replay the topic into a new directory"
        )

    def _apply(self, progress: _PartitionProgress, routed: Routed, read: Read) -> None:
        """Carry one routing decision out through the projection and remember its verdict."""
        result = carry_out(self._projection, self._topic, routed)
        count_applied(self._projection.state_of, routed, result)
        if isinstance(routed, ApplyEvent) and isinstance(routed.event, FreezeEvent):
            observe_freeze(read.read_at, time.monotonic())
        answered = False
        if result is not None and isinstance(routed, ApplyEvent):
            answered = self._answer(routed, result, read.read_at)
            refused = refused_staging_reason(routed, result)
            if refused is not None:
                progress.refused[routed.offset] = refused
        if result is not None and (
            isinstance(routed, ApplyEvent) or (isinstance(routed, DeadLetter) and not routed.abandoned)
        ):
            with self._condition:
                self._results[(routed.partition, routed.offset)] = result
                while len(self._results) > _RESULTS_KEPT:
                    self._results.popitem(last=False)
        if isinstance(routed, ApplyEvent) and isinstance(routed.event, COMMANDS) and not answered:
            self._unanswered.append((routed.event.type, read.read_at))

    def _record_dead_letter(self, progress: _PartitionProgress, routed: Routed) -> None:
        """Write the dead-letter line of a decision that failed, in log order whenever its mask was applied."""
        if isinstance(routed, ApplyEvent) and routed.offset in progress.refused:
            reason = progress.refused.pop(routed.offset)
            logger.warning(
                "dead-lettering partition %d offset %d of %s: %s",
                routed.partition,
                routed.offset,
                self._topic,
                reason,
            )
            rollout_id = routed.event.rollout_id
            written = progress.dead_letters.record(routed.partition, routed.offset, reason, rollout_id)
            if written:
                count_dead_letter(routed)
            if written and self._on_dead_letter is not None:
                self._on_dead_letter(DeadLetterLine(routed.partition, routed.offset, rollout_id, reason))
            return
        if not isinstance(routed, DeadLetter):
            return
        logger.warning(
            "dead-lettering partition %d offset %d of %s: %s",
            routed.partition,
            routed.offset,
            self._topic,
            routed.reason,
        )
        written = progress.dead_letters.record(
            routed.partition, routed.offset, routed.reason, routed.rollout_id
        )
        if written:
            count_dead_letter(routed)
        if written and self._on_dead_letter is not None:
            self._on_dead_letter(
                DeadLetterLine(
                    routed.partition, routed.offset, routed.rollout_id, routed.reason[:REASON_LIMIT]
                )
            )


def _cached_end(consumer: Consumer, topic: str, partition: int) -> int | None:
    """The partition's end as the consumer last saw it in a fetch; ``None`` before any fetch.

    A cached read sends no request, so nothing is translated: a failure (a partition the handle does not know
    yet, a consumer closing) only means the end is not known now, and the scrape reports no lag.
    """
    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
    except (KafkaException, RuntimeError):
        return None
    return int(high) if high is not None and high >= 0 else None


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, not {port}")
    return port


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m transports.kafka.materializer",
        description="Apply a tokcap run topic to a local store directory until SIGINT or SIGTERM.",
    )
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers, host:port[,host:port]")
    parser.add_argument("--topic", required=True, help="the run topic to read")
    parser.add_argument("--dir", required=True, type=Path, help="the store directory to write")
    parser.add_argument(
        "--partitions", default=None, help="comma-separated subset of partitions (default: all)"
    )
    parser.add_argument(
        "--block-messages",
        type=int,
        default=SWEEP_BLOCK_MESSAGES,
        help=f"most messages applied per durable block before a checkpoint (default: {SWEEP_BLOCK_MESSAGES})",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve Prometheus /metrics and a /healthz readiness check on this port (0: any free port)",
    )
    parser.add_argument(
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        help=f"the address --metrics-port listens on (default: {DEFAULT_METRICS_HOST})",
    )
    return parser.parse_args(argv)


_YOUNG_COLLECTION_THRESHOLD = 20_000
"""Container allocations between the collector's youngest passes in a materializer's own process (Python: 700)."""


def collect_less_after_start_up() -> None:
    """Leave the start-up heap out of every collection and run the youngest pass less often.

    Each pass walks every young container, and an applied put leaves long lists of token ids behind (its
    entry, kept hot by the projection): at Python's default a pass ran every 60-odd events and the passes
    took 15-25% of the apply step's CPU. Garbage cycles are rare here, so fewer passes free them a little later
    and cost nothing else. Only a process that is a materializer and nothing else sets this; a trainer that
    hosts one keeps its own settings, and may call this after its own start-up.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


def main(argv: Sequence[str] | None = None) -> int:
    """Run a materializer process; it stops cleanly, checkpoint written, on SIGINT or SIGTERM."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    partitions = None if args.partitions is None else [int(p) for p in args.partitions.split(",") if p]
    try:
        materializer = Materializer(
            args.bootstrap, args.topic, args.dir, partitions, block_messages=args.block_messages
        )
    except InvalidInputError as exc:
        print(f"materializer not started: {exc}", file=sys.stderr)
        return 2

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        materializer.request_stop()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    with ExitStack() as serving:
        if args.metrics_port is not None:
            # Imported here: readiness imports this module.
            from transports.kafka.materializer.readiness import serve_metrics

            server = serve_metrics(materializer, host=args.metrics_host, port=args.metrics_port)
            serving.callback(server.close)
            logger.info("serving /metrics and /healthz on http://%s:%d", server.host, server.port)
        collect_less_after_start_up()
        try:
            materializer.run_until_stopped()
        except MaterializerFailedError as exc:
            print(f"materializer failed: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

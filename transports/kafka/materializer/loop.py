"""The materializer: applies the run topic's events to a local file store, in log order per rollout.

It reads each assigned partition from its own checkpoint in the store directory (``checkpoint``),
not from consumer-group offsets, routes every message through the inbound router (``router``) and
applies what it decides, with the event's log position, through the directory's single-writer projection
(``tokcap.files.log_projection``: hot state in memory, flushed in blocks before each checkpoint). This module
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

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from tokcap.files.durable_io import remove_stale_temp_files
from tokcap.files.log_projection import Projection
from tokcap.files.store import TokenCaptureStore
from tokcap.metrics import LoopStatus, watch_loop
from transports.kafka.client.admin import TopicIdReader
from transports.kafka.client.clients import (
    AuthenticationWatch,
    ClientContext,
    open_reader,
)
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.client.offset_reader import OffsetReader
from transports.kafka.client.payload_reader import payload_restorer
from transports.kafka.client.topics import validate_topic_name
from transports.kafka.materializer.apply import carry_out
from transports.kafka.materializer.apply_decisions import DecisionApplier
from transports.kafka.materializer.block_checkpoints import BlockCheckpoints
from transports.kafka.materializer.checkpoint import (
    CHECKPOINT_PREFIX,
    PartitionCheckpoint,
)
from transports.kafka.materializer.dead_letters import DEAD_LETTER_PREFIX, DeadLetterLine, DeadLetterLog
from transports.kafka.materializer.incarnation import IncarnationWatch
from transports.kafka.materializer.log_reader import LogReader
from transports.kafka.materializer.loop_status import cached_end, loop_status_of
from transports.kafka.materializer.loop_thread import LoopThread
from transports.kafka.materializer.ownership import hold_partition
from transports.kafka.materializer.partition_progress import PartitionProgress
from transports.kafka.materializer.schedule import MaterializerCounters, Scheduler
from transports.kafka.materializer.settings import (
    DEFAULT_SETTINGS,
    MaterializerSettings,
    check_block_messages,
)
from transports.kafka.materializer.start import (
    asked_until,
    bind_directory,
    check_skipped_types,
    topic_partitions,
)
from transports.kafka.wire.delta_parents import ParentRestorer
from transports.kafka.wire.router import (
    MATERIALIZER_WRITER,
    ORPHAN_AFTER_OFFSETS,
    InboundRouter,
)
from transports.kafka.wire.topic_limits import TopicLimits, check_given, warn_given

# CHECKPOINT_PREFIX, DEAD_LETTER_PREFIX, MATERIALIZER_WRITER and ORPHAN_AFTER_OFFSETS live in their own
# modules now; they stay importable from here.
__all__ = [
    "CHECKPOINT_PREFIX",
    "DEAD_LETTER_PREFIX",
    "DEFAULT_SETTINGS",
    "MATERIALIZER_WRITER",
    "ORPHAN_AFTER_OFFSETS",
    "DeadLetterLog",
    "Materializer",
    "MaterializerCounters",
    "MaterializerSettings",
    "PartitionCheckpoint",
    "carry_out",
    "logger",
    "remove_stale_temp_files",
]

logger = logging.getLogger(__name__)


class Materializer(LoopThread):
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
        settings: MaterializerSettings | None = None,
    ) -> None:
        """``consumer_factory`` builds the consumer from its settings; tests pass an in-memory topic double.

        ``topic_id_reader`` returns the topic's id now (``TopicIdReader`` by default; a test double passes its
        own): the directory is bound to that incarnation of the topic.

        ``on_dead_letter`` is called, on the materializer's thread, with each dead-letter line once it is
        written (``tokcap materialize`` prints them); it must not block.

        ``settings`` holds the loop's tuning (``materializer_settings``; ``DEFAULT_SETTINGS`` by default).
        ``block_messages``, given, replaces its bound on the in-order sweep's durable blocks.

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
        settings = DEFAULT_SETTINGS if settings is None else settings
        if block_messages is not None:
            settings = replace(settings, block_messages=check_block_messages(block_messages))
        self._settings = settings
        self._on_dead_letter = on_dead_letter
        self._new_consumer = consumer_factory
        self._topic = validate_topic_name(topic)
        self._skipped_types = frozenset(skipped_types)
        check_skipped_types(Path(store_dir), self._skipped_types)
        self._store = TokenCaptureStore(store_dir)
        self._requested_partitions = None if partitions is None else sorted(set(partitions))
        self._consumer_config = dict(consumer_config or {})
        self._client = ClientContext(bootstrap_servers, self._consumer_config)
        self._watch = AuthenticationWatch(self._client)
        self._read_topic_id = topic_id_reader or TopicIdReader(
            bootstrap_servers,
            self._topic,
            client_config=self._consumer_config,
            timeout_s=settings.id_read_timeout_s,
        )
        self._incarnation: IncarnationWatch | None = None
        self._read_limits = limits_reader or functools.partial(
            read_topic_limits,
            self._client,
            self._topic,
            watch=self._watch,
            factory=self._new_consumer,
            timeout_s=settings.id_read_timeout_s,
        )
        self._given_limits = {
            "max_event_bytes": max_event_bytes,
            "max_open_chunk_bytes": max_open_chunk_bytes,
        }
        if max_event_bytes is not None or max_open_chunk_bytes is not None:
            warn_given("Materializer", self._given_limits)
        self._progress: dict[int, PartitionProgress] = {}
        # Wire deltas whose parent the router no longer keeps (a resume past it) read it again from the log.
        self._parent_reader = OffsetReader(
            self._client, self._topic, purpose="materializer", watch=self._watch, factory=self._new_consumer
        )
        # Staged references read their payload from the staged-payload topic the run topic's record names.
        self._payloads = payload_restorer(
            self._client, purpose="materializer-payloads", watch=self._watch, factory=self._new_consumer
        )
        self._router = InboundRouter(
            topic=self._topic, parents=ParentRestorer(self._parent_reader.read), payloads=self._payloads
        )
        self._schedule = Scheduler(
            time.monotonic,
            first_command_block=settings.first_command_block,
            most_command_block=settings.most_command_block,
            decode_first_tokens=settings.decode_first_tokens,
        )
        self._projection = Projection(
            self._store, hot_tokens=settings.hot_tokens, hot_rollouts=settings.hot_rollouts
        )
        """The store's hot rollouts in memory: what the loop applies goes through it, and it answers the sources'
        commands by position (freezes from memory before their block is flushed)."""
        self._checkpoints = BlockCheckpoints(
            self._store.root, self._projection, self._schedule, self._router, self._progress
        )
        self._applier = DecisionApplier(
            self._topic, self._projection, self._router, self._schedule, self._checkpoints, self._progress
        )
        super().__init__(f"tokcap-materializer-{self._topic}", self._topic, self._checkpoints.waiters)
        self._condition = self._waiters.condition
        """Guards what the waits read (durable checkpoints, commands carried out ahead) and what other threads read."""
        self._consumer: Consumer | None = None
        """The loop's consumer while it owns its partitions: a scrape reads its cached end offsets."""
        self._consumer_lock = threading.Lock()
        watch_loop(self)

    # ---------------------------------------------------------------- public

    @property
    def store(self) -> TokenCaptureStore:
        """The store this materializer writes."""
        return self._store

    @property
    def projection(self) -> Projection:
        """The projection this materializer applies through; it answers commands by position (``verdict_at``,
        ``snapshot_at``) once ``applied`` says they are applied."""
        return self._projection

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
        return self._settings.block_messages

    @property
    def settings(self) -> MaterializerSettings:
        """The loop's tuning."""
        return self._settings

    def applied_offsets(self) -> dict[int, int]:
        """Per partition, the next offset to apply: every offset below it is applied and checkpointed."""
        return self._checkpoints.applied_offsets()

    def answer_freezes_for(self, writer: str) -> None:
        """Carry this writer's freezes out as soon as they are read, so the projection answers them from memory.

        Each freeze is applied right away, after its own rollout's earlier events only, and ``applied`` with
        ``ahead`` ends its wait then, before its block is flushed (``tokcap.files.log_projection`` says why answering
        it is safe). Freezes of other writers (sources in other processes read the files once the checkpoint
        passes them) wait for their turn.
        """
        with self._condition:
            self._schedule.serve(writer)

    def stop_answering_for(self, writer: str) -> None:
        """Undo one ``answer_freezes_for``; the writer's later freezes wait for their turn."""
        with self._condition:
            self._schedule.stop_serving(writer)

    def counters(self) -> MaterializerCounters:
        """A copy of the loop's counters."""
        with self._condition:
            return MaterializerCounters(**self._schedule.counters.__dict__)

    def loop_status(self) -> LoopStatus:
        """Where the loop stands now, read from another thread (a metrics scrape, a health check)."""
        with self._consumer_lock:
            consumer = self._consumer
            ends = {p: cached_end(consumer, self._topic, p) for p in self._progress} if consumer else {}
        with self._condition:
            failed = self._waiters.failure
        return loop_status_of(
            self._topic,
            running=consumer is not None,
            failed=failed,
            ends=ends,
            progress=self._progress,
            schedule=self._schedule,
            checkpoints=self._checkpoints,
            kept_tokens=self._projection.kept_tokens,
        )

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
        backlog before it may still be waiting. With ``ahead`` as well, a command carried out ahead of its
        block's flush is waited for no further: the projection answers it from memory. Many trainers' freezes
        wait at once; a blocking wait per freeze would queue them behind the event loop's few executor threads.
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
        return topic_partitions(
            consumer,
            self._watch,
            self._client,
            self._topic,
            unknown_wait_s=self._settings.unknown_topic_wait_s,
            stop=self._stop,
            timeout_s=timeout_s,
        )

    def _run(self) -> None:
        consumer = self._open_reader()
        try:
            with ExitStack() as held:
                partitions = self._partitions(consumer)
                for partition in partitions:
                    held.enter_context(hold_partition(self._store.root, self._topic, partition))
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
            self._payloads.close()

    def _bind(self, partitions: list[int]) -> dict[int, PartitionCheckpoint]:
        """Read the topic's id and limits, bind the directory to that incarnation; the checkpoints to resume from."""
        timeout_s = self._settings.metadata_timeout_s
        topic_id = asked_until(
            self._read_topic_id, f"the id of topic {self._topic}", timeout_s=timeout_s, stop=self._stop
        )
        limits = asked_until(
            self._read_limits, f"the limits of topic {self._topic}", timeout_s=timeout_s, stop=self._stop
        )
        check_given("Materializer", self._topic, limits, **self._given_limits)
        self._router.limits = limits
        checkpoints = bind_directory(self._store.root, self._topic, partitions, topic_id)
        self._incarnation = IncarnationWatch(self._topic, topic_id, self._read_topic_id)
        return checkpoints

    @property
    def limits(self) -> TopicLimits:
        """The topic's limits this materializer reads by (the defaults until it has started)."""
        return self._router.limits

    def _consume(self, consumer: Consumer, checkpoints: Mapping[int, PartitionCheckpoint]) -> None:
        for partition, checkpoint in checkpoints.items():
            self._progress[partition] = PartitionProgress.resuming(self._store.root, partition, checkpoint)
            self._schedule.open(partition, checkpoint.next_offset)
            self._checkpoints.resume(partition, checkpoint)
        assert self._incarnation is not None
        self._incarnation.start()
        reader = LogReader(
            self._topic,
            self._store.root,
            self._settings,
            self._client,
            self._watch,
            self._incarnation,
            self._router,
            self._schedule,
            self._progress,
            self._skipped_types,
            self._stop,
        )
        reader.assign(consumer)
        with self._consumer_lock:
            self._consumer = consumer
        self._ready.set()
        swept: int | None = None
        """Messages swept in the open sweep block; ``None`` between blocks."""
        settle = False
        while not (self._stop.is_set() and swept is None):
            reader.read(consumer, self._applier.command_read)  # the loop's one read site
            if swept is None:
                # Commands first, in a block and a checkpoint of their own: their sources are answered before
                # the sweep of other rollouts' events. Each block shares one filesystem sync; the checkpoint is
                # written only after it is durable.
                if self._schedule.commands_waiting():
                    self._applier.carry_out_commands()
                    self._checkpoints.end_block("commands")
                    if self._schedule.command_block_done():
                        continue  # a burst: the sweep waits until it is answered
                self._schedule.end_burst()
                swept = 0
            elif self._schedule.commands_waiting():
                self._checkpoints.end_block("sweep")  # a command read between two steps ends the sweep block
                swept = None
                continue
            elif settle:
                self._router.settle_oldest(time.monotonic() + self._settings.settle_step_s)
            swept, settle = self._sweep_turn(swept)

    def _sweep_turn(self, swept: int) -> tuple[int | None, bool]:
        """One step of the open sweep block, which has swept ``swept`` messages; then the loop reads again.

        An in-process source's freeze is carried out as soon as it is read, so reading between steps keeps its
        wait to one step of the sweep rather than a whole block. While the scheduler decodes first, what was
        read is decoded before any of it is swept: a burst of freezes then finds its rollouts decoded.
        Returns the block's new count (``None`` once it ended with its checkpoint) and whether decoding ahead
        gets its time after the next read.
        """
        settings = self._settings
        if swept >= settings.block_messages:
            self._checkpoints.end_block("sweep")
            return None, False
        if self._schedule.decodes_first(self._router.decoded_ahead_tokens):
            self._router.settle_oldest(
                time.monotonic() + settings.settle_step_s, settings.decode_first_tokens
            )
            # Left undecoded: the deadline passed (read, then decode on), or the bound is reached (sweep).
            if not self._router.all_decoded() and not self._schedule.decoded_enough(
                self._router.decoded_ahead_tokens
            ):
                return swept, False
        step = self._sweep(
            min(settings.sweep_step_messages, settings.block_messages - swept), settings.sweep_step_s
        )
        if not self._schedule.held_messages:
            self._router.settle_oldest(0.0)  # everything is applied: let go of what it was
        if not step or not self._schedule.held_messages:
            self._checkpoints.end_block("sweep")
            return None, False
        return swept + step, True

    def _sweep(self, budget: int, step_s: float | None = None) -> int:
        """Finish up to ``budget`` messages in log order, starting none after ``step_s`` seconds but the first.

        Return how many were finished.
        """
        swept_before = self._schedule.counters.messages_swept
        for step in self._schedule.sweep(budget, step_s):
            progress = self._progress[step.partition]
            decision = self._applier.settled(step.read, step.index)
            if step.carry:
                self._applier.apply(progress, decision, step.read)
            progress.record_dead_letter(self._topic, decision, self._on_dead_letter)
        return self._schedule.counters.messages_swept - swept_before

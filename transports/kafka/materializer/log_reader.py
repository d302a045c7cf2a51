"""The materializer's one read site: fetch what the read-ahead has room for, check it, route it, schedule it.

Each assigned partition is read from its resume offset on, every fetched offset following the last one
(``partition_progress.out_of_sequence`` otherwise). Below a partition's checkpoint only the chunks of groups
open there are taken again; every other message is routed (``router``) and handed to the scheduler, and each
command it holds is reported to the loop once the topic's incarnation is confirmed (a source is never
answered from a topic created again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, Message

from transports.kafka.client.clients import AuthenticationWatch, ClientContext, assign_reader
from transports.kafka.client.error_map import read_failure
from transports.kafka.materializer.incarnation import IncarnationWatch
from transports.kafka.materializer.loop_metrics import observe_command_read_delay
from transports.kafka.materializer.partition_progress import PartitionProgress, out_of_sequence
from transports.kafka.materializer.schedule import Read, Scheduler
from transports.kafka.materializer.settings import MaterializerSettings
from transports.kafka.wire.codec import ENCODING_STAGED_REFERENCE, HEADER_ENCODING, LogMessage, type_header
from transports.kafka.wire.router import ApplyEvent, Deferred, InboundRouter, Routed

__all__ = ["LogReader", "logger"]

logger = logging.getLogger("transports.kafka.materializer")
"""The materializer's own logger: its start is reported where its operators look."""


@dataclass
class LogReader:
    """Reads a materializer's partitions and routes what it reads; the loop's only reader of messages."""

    topic: str
    root: Path
    """The store directory, named in the errors of a broken offset sequence."""
    settings: MaterializerSettings
    client: ClientContext
    watch: AuthenticationWatch
    incarnation: IncarnationWatch
    router: InboundRouter
    schedule: Scheduler
    progress: Mapping[int, PartitionProgress]
    skipped_types: frozenset[str]
    stop: threading.Event
    fetched_at: float = 0.0
    fetched_at_wall: float = 0.0
    """When the last read returned on the wall clock, which log timestamps are on."""
    """When the batch being routed was fetched (``time.monotonic``)."""

    def assign(self, consumer: Consumer) -> None:
        """Assign the consumer every partition at its resume offset."""
        resume = {partition: progress.fetch_next for partition, progress in self.progress.items()}
        assign_reader(consumer, self.client, self.watch, self.topic, resume, self.settings.metadata_timeout_s)
        logger.info(
            "materializer ready: topic %s, resuming at %s, blocks of up to %d messages",
            self.topic,
            resume,
            self.settings.block_messages,
        )

    def read(self, consumer: Consumer, on_command: Callable[[int, Read, int], None]) -> None:
        """Read and route the next messages; ``on_command(partition, read, index)`` for each command read."""
        for message in self._fetch(consumer):
            self._take(message, on_command)

    def _fetch(self, consumer: Consumer) -> list[Message]:
        """The next messages to route, as many as the read-ahead has room for (none when it is full).

        Wait for one message only when nothing is left to apply; then take what is already fetched:
        consume(n, t) alone blocks until n messages or t, which would delay every freeze by up to t.
        """
        settings, schedule = self.settings, self.schedule
        room = min(settings.read_step, settings.read_ahead_messages - schedule.held_messages)
        if room <= 0 or schedule.held_bytes >= settings.read_ahead_bytes:
            return []
        idle = schedule.held_messages == 0
        messages = list(consumer.consume(1, settings.poll_timeout_s if idle else 0))
        self.watch.raise_if_failed()
        if messages and room > 1:
            messages.extend(consumer.consume(room - 1, 0))
        self.fetched_at = time.monotonic()
        self.fetched_at_wall = time.time()
        # Checked after the fetch: what was fetched before a change seen now is not routed.
        self.incarnation.raise_if_changed()
        return messages

    def _take(self, message: Message, on_command: Callable[[int, Read, int], None]) -> None:
        """Take one consumed message: an error, a replayed chunk, a skipped offset or a new message to route."""
        error = message.error()
        if error is not None:
            self._on_consumer_error(error)
            return
        partition, offset = int(message.partition() or 0), int(message.offset() or 0)
        progress = self.progress.get(partition)
        if progress is None:
            return
        if offset != progress.fetch_next:
            # A topic deleted and created again shows first as a broken sequence: say so if it is.
            self.incarnation.check_now()
            self.incarnation.raise_if_changed()
            raise out_of_sequence(self.topic, self.root, partition, progress.fetch_next, offset)
        progress.fetch_next = offset + 1
        if offset < progress.replay_below:
            # Processed before the checkpoint; only the chunks of groups open there are needed again.
            if offset in progress.replay_chunks:
                progress.replay_chunks.discard(offset)
                self.router.rebuffer(LogMessage.of(message))
            return
        log_message = LogMessage.of(message)
        chunks_before = tuple(self.router.open_chunk_offsets(partition))
        routed: list[Routed | Deferred]
        if self.skipped_types and type_header(log_message.headers) in self.skipped_types:
            routed = list(self.router.pass_over(log_message))
        else:
            routed = self.router.route_deferring(log_message)
        read = Read(
            offset,
            routed,
            [False] * len(routed),
            chunks_before,
            _held_bytes(log_message, routed),
            timestamp_ms=log_message.timestamp_ms,
            read_at=self.fetched_at,
        )
        for index in self.schedule.add(partition, read):
            command = routed[index]
            assert isinstance(command, ApplyEvent), "a command is decided when it is routed"
            observe_command_read_delay(command.event.type, read.timestamp_ms, self.fetched_at_wall)
            # No source is answered from a topic created again: prove the incarnation first (one
            # request per batch read, however many commands it holds).
            self.incarnation.confirm_since(self.fetched_at, self.stop)
            on_command(partition, read, index)

    def _on_consumer_error(self, error: KafkaError) -> None:
        failure = read_failure(error, self.client, self.topic)
        if failure is not None:
            # A topic deleted and created again shows first as an offset out of range: say so if it is.
            self.incarnation.check_now()
            self.incarnation.raise_if_changed()
            raise failure


def _held_bytes(message: LogMessage, routed: list[Routed | Deferred]) -> int:
    """What the read-ahead holds for a message: its bytes, or a staged reference's payload, restored with it."""
    if (HEADER_ENCODING, ENCODING_STAGED_REFERENCE.encode()) not in message.headers:
        return message.size
    return max([message.size, *(decided.size for decided in routed if isinstance(decided, ApplyEvent))])

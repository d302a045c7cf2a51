"""Reading a rollout's partition of a run topic up to its end as of a resolve, and folding what was read.

A rollout's events are keyed by its id, so they all sit, in order, in one partition. Before a resolve answers,
its partition is read up to its end as of the call (its high watermark, asked of the broker each time), so
any ``put`` acknowledged before the call is seen: read-your-writes per rollout, on any node, including a
resolver built after the put. Kafka has no partial fetch, so every message's bytes cross the wire; what they
mean is ``rollout_logs``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable

from confluent_kafka import OFFSET_END, Consumer, KafkaException, Message, TopicPartition

from tokcap.errors import TransportError
from transports.kafka.client.admin import partition_count
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, assign_reader, open_reader
from transports.kafka.client.error_map import Request, read_failure, translated
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.lineage.rollout_logs import RolloutLogs
from transports.kafka.lineage.shared_question import SharedQuestion
from transports.kafka.wire.partitioner import partition_of_rollout
from transports.kafka.wire.topic_limits import TopicLimits

__all__ = ["PartitionReader"]

_FOLD_STEP = 16
"""Messages folded per hold of the lock."""


class PartitionReader:
    """The resolver's two consumer handles and how far each partition is read and folded into ``logs``.

    ``lock`` guards the folded state (``logs`` and the offsets read) and is never held while waiting on the
    broker; ``raise_if_closed`` stops a read once the resolver is closed.
    """

    def __init__(
        self,
        *,
        context: ClientContext,
        topic: str,
        partitioner: str,
        timeout_s: float,
        lock: threading.Lock,
        logs: RolloutLogs,
        raise_if_closed: Callable[[], None],
    ) -> None:
        self._context = context
        self._topic = topic
        self._partitioner = partitioner
        self._timeout_s = timeout_s
        self._logs = logs
        self._raise_if_closed = raise_if_closed
        self._end_request = Request(f"read the end of {topic!r}", timeout_s)
        self._read_request = Request(f"read {topic!r}", timeout_s)
        self._watch = AuthenticationWatch(context)
        self._consumer: Consumer = self._open_reader()
        # A second handle asks the broker questions (metadata, offsets): a request on the reading handle waits
        # behind another thread's consume call (measured: seconds, past its own timeout), one here does not.
        self._asker: Consumer = self._open_reader()
        self._unassigned: dict[int, int] = {}
        """Partitions to start reading, at their first offset; the reader assigns them, as the consumer is used
        by one thread at a time."""
        self._lock = lock
        self._read = threading.Condition(lock)
        """Notified whenever the reader has folded what it read (or given up reading)."""
        self._reading = False
        """True while one caller reads for every waiting caller; the consumer is never read from two threads."""
        self._partitions: int | None = None
        self._next: dict[int, int] = {}
        self._assigning: defaultdict[int, threading.Lock] = defaultdict(threading.Lock)
        self._ends = SharedQuestion()
        self._limits: TopicLimits | None = None

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

    def read_rollout_partition(self, rollout_id: str) -> None:
        """Read the rollout's partition up to its end as of now, folding every message into the logs."""
        with self._lock:
            self._raise_if_closed()
            partition = self._partition_of(rollout_id)
        self._assign(partition)
        # The end is asked outside the lock, and concurrent calls share one question for all their partitions.
        high = self._ends.ask(partition, self._ends_of)
        self._catch_up(partition, high)

    def wake_waiting(self) -> None:
        """Wake every caller waiting for a read (the resolver is closing); lock held."""
        self._read.notify_all()

    def close(self) -> None:
        """Wait for a read in progress (at most one short consume) to end, then close both handles."""
        with self._read:
            while self._reading:
                self._read.wait()
        self._consumer.close()
        self._asker.close()

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
                    self._limits = limits
                    self._logs.use_limits(limits)
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
        self._logs.take(message, partition, offset)
        return None

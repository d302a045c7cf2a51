"""Read a staged-payload topic forward, keeping what a later reference will ask for.

A reader of a run topic restores each stage reference from its pieces (``wire.staged_payloads``). Pieces are
written just before their references and in nearly the same order, so reading the payload topic forward from
the first piece asked for finds the next ones already fetched. Reading each piece alone (``OffsetReader``:
assign, fetch, unassign) would cost a round trip per piece and cap a materializer at a few hundred stages a
second.

``PayloadReader.read(partition, offset)``:

- a piece read ahead is answered from memory, and forgotten: each piece is asked for once;
- a piece ahead of the partition's position is reached by reading forward, keeping every message passed;
- a piece behind the position (a resume, a piece forgotten, a reference to an older payload) moves the
  position back to it first.

Memory is bounded: past ``max_kept_bytes`` the oldest kept messages are forgotten, and read again if asked
for. A piece the log does not hold (trimmed, or past the end of a topic created again) gives ``None``; a broker
that does not answer raises ``TransportError``, never ``None``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from tokcap.errors import TransportError
from transports.kafka.client.clients import AuthenticationWatch, ClientContext, assign_reader, open_reader
from transports.kafka.client.error_map import Request, translated
from transports.kafka.wire.codec import LogMessage
from transports.kafka.wire.staged_payloads import StagedPayloadRestorer

__all__ = ["DEFAULT_KEPT_BYTES", "READER_SETTINGS", "PayloadReader", "payload_restorer"]

DEFAULT_KEPT_BYTES = 64 * 1024 * 1024
"""Payload bytes read ahead and kept until asked for; more concurrent stagers interleave more pieces."""

_POLL_S = 0.2
_BATCH = 16
"""Messages taken per consume: what one read may pass beyond its piece stays far below ``max_kept_bytes``, so
the oldest kept pieces, which eviction drops first, are those no reference asked for (a sink died between its
two sends) or asked for far out of order. A batch that alone fills the memory would evict the very pieces the
next references ask for, and every read would move back and fetch them again."""
_OUT_OF_RANGE = frozenset({KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET})

READER_SETTINGS = {"fetch.wait.max.ms": 10, "enable.partition.eof": True, "fetch.queue.backoff.ms": 5}
"""Fixed over the reader's settings: a short long-poll, so moving back does not wait for a fetch in flight; the
end of a partition reported, so a piece past the end the broker gives is found missing, not awaited; and the
next fetch sent 5 ms after the prefetch queue was full instead of librdkafka's 1 s. With 1 s, a reader that
writes each payload durably between reads waited for pieces half the time (1.46 of 2.57 s over 1,000 pieces of
256 KiB; 0.05 of 0.83 s with 5 ms); with 0 ms a fetcher thread spins while the queue is full."""


class PayloadReader:
    """One forward reader over a staged-payload topic's partitions; not thread-safe (one reader thread)."""

    def __init__(
        self,
        context: ClientContext,
        topic: str,
        *,
        purpose: str = "payloads",
        watch: AuthenticationWatch | None = None,
        factory: Callable[[dict[str, Any]], Consumer] = Consumer,
        timeout_s: float = 30.0,
        max_kept_bytes: int = DEFAULT_KEPT_BYTES,
    ) -> None:
        self._context = context
        self._topic = topic
        self._purpose = purpose
        self._watch = watch or AuthenticationWatch(context)
        self._factory = factory
        self._timeout_s = timeout_s
        self._max_kept_bytes = max_kept_bytes
        self._consumer: Consumer | None = None
        self._positions: dict[int, int] = {}
        """Per partition, the offset of the next message the consumer returns."""
        self._kept: OrderedDict[tuple[int, int], LogMessage] = OrderedDict()
        self._kept_bytes = 0
        self._ended_at: dict[int, int] = {}
        """Per partition, the offset where its end was last reported (the report comes once, not again)."""
        self.moves = 0
        """Times a position was moved (back, or to a partition not read yet): a counter for tests and benchmarks."""

    def read(self, partition: int, offset: int) -> LogMessage | None:
        """The message at this position; ``None`` when the log does not hold it."""
        kept = self._kept.pop((partition, offset), None)
        if kept is not None:
            self._kept_bytes -= kept.size
            return kept
        position = self._positions.get(partition)
        if position is None or offset < position:
            self._move(partition, offset)
        elif self._ended_at.get(partition) == position and self._end_now(partition) <= offset:
            # The partition was read to its end, which was reported once: ask the broker where it is now.
            return None
        return self._read_forward(partition, offset)

    def _move(self, partition: int, offset: int) -> None:
        """Read ``partition`` from ``offset`` next; the other partitions keep their positions."""
        self.moves += 1
        self._positions[partition] = offset
        self._ended_at.pop(partition, None)
        if self._consumer is None:
            self._consumer = open_reader(
                self._context,
                self._topic,
                self._positions,
                purpose=self._purpose,
                watch=self._watch,
                timeout_s=self._timeout_s,
                fixed=READER_SETTINGS,
                factory=self._factory,
            )
        else:
            assign_reader(
                self._consumer, self._context, self._watch, self._topic, self._positions, self._timeout_s
            )

    def _read_forward(self, partition: int, offset: int) -> LogMessage | None:
        consumer = self._consumer
        assert consumer is not None
        deadline = time.monotonic() + self._timeout_s
        asked = Request(f"read offset {offset} of partition {partition} of {self._topic!r}", self._timeout_s)
        with translated(self._context, asked):
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(
                        f"could not read offset {offset} of partition {partition} of {self._topic!r} within "
                        f"{self._timeout_s:g} s; is the broker reachable?"
                    )
                self._watch.raise_if_failed()
                # Every message of a batch is taken, the ones after the answer too: they are consumed.
                answered, answer = False, None
                # consume(n, t) waits for n messages or t: wait for one, then take what is already fetched.
                batch = consumer.consume(1, min(remaining, _POLL_S))
                if batch:
                    batch.extend(consumer.consume(_BATCH - 1, 0))
                for message in batch:
                    if answered:
                        self._take_passed(message)
                    else:
                        answered, answer = self._take(message, partition, offset)
                if answered:
                    return answer

    def _take(self, message: Message, partition: int, offset: int) -> tuple[bool, LogMessage | None]:
        """What one consumed message says of the piece asked for: ``(True, it)``, ``(True, None)`` when it is
        missing, or ``(False, None)`` while it is not among the messages read so far."""
        error = message.error()
        at = int(message.partition() or 0)
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                self._ended_at[at] = int(message.offset() or 0)
                # The end was reached, but the report may predate the piece's write: only the end offset the
                # broker gives now says whether the piece is past it.
                return (at == partition and self._end_now(partition) <= offset), None
            if error.code() in _OUT_OF_RANGE:
                if at != partition:
                    self._drop(at)
                    return False, None
                if self._positions.get(at) == offset:
                    # The piece itself is out of range; the partition is read again from where asked next.
                    self._drop(at)
                    return True, None
                # The position before the piece was trimmed; the piece itself may still be there.
                self._move(partition, offset)
                return False, None
            raise KafkaException(error)
        found = int(message.offset() or 0)
        self._positions[at] = found + 1
        read = LogMessage.of(message)
        if at == partition and found == offset:
            return True, read
        self._keep(read)
        return (at == partition and found > offset), None

    def _take_passed(self, message: Message) -> None:
        """Keep a message consumed after the answer; a partition whose position left the log is dropped."""
        error = message.error()
        if error is not None:
            if error.code() in _OUT_OF_RANGE:
                self._drop(int(message.partition() or 0))
            elif error.code() == KafkaError._PARTITION_EOF:
                self._ended_at[int(message.partition() or 0)] = int(message.offset() or 0)
            else:
                raise KafkaException(error)
        else:
            found = int(message.offset() or 0)
            self._positions[int(message.partition() or 0)] = found + 1
            self._keep(LogMessage.of(message))

    def _end_now(self, partition: int) -> int:
        assert self._consumer is not None
        _, high = self._consumer.get_watermark_offsets(
            TopicPartition(self._topic, partition), timeout=self._timeout_s, cached=False
        )
        return int(high)

    def _drop(self, partition: int) -> None:
        """Stop reading a partition whose position left the log; it is moved again when asked for."""
        del self._positions[partition]
        self._ended_at.pop(partition, None)
        assert self._consumer is not None
        assign_reader(
            self._consumer, self._context, self._watch, self._topic, self._positions, self._timeout_s
        )

    def _keep(self, message: LogMessage) -> None:
        self._kept[(message.partition, message.offset)] = message
        self._kept_bytes += message.size
        while self._kept_bytes > self._max_kept_bytes and self._kept:
            _, oldest = self._kept.popitem(last=False)
            self._kept_bytes -= oldest.size

    def close(self) -> None:
        """Close the consumer, if one was opened, and forget what was kept."""
        consumer, self._consumer = self._consumer, None
        self._kept.clear()
        self._kept_bytes = 0
        if consumer is not None:
            consumer.close()


def payload_restorer(
    context: ClientContext,
    *,
    purpose: str,
    watch: AuthenticationWatch | None = None,
    factory: Callable[[dict[str, Any]], Consumer] = Consumer,
    timeout_s: float = 30.0,
) -> StagedPayloadRestorer:
    """The restorer a reader of a run topic gives its inbound router: a ``PayloadReader`` per payload topic."""
    return StagedPayloadRestorer(
        lambda payload_topic: PayloadReader(
            context, payload_topic, purpose=purpose, watch=watch, factory=factory, timeout_s=timeout_s
        )
    )

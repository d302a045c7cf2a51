"""The materializer: applies the run topic's events, in log order, to a local file store.

It reads each assigned partition from its own checkpoint in the store directory (``checkpoint``),
not from consumer-group offsets, routes every message through the inbound router (``router``) and
applies what it decides through ``TokenCaptureStore.apply`` with the event's log position. This module
holds only that loop and the waits on it.

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

An event that cannot be decoded, has an unknown type or a newer schema, or a chunk group that can
never complete, goes to the partition's dead-letter log (``dead_letters``) with its partition, offset and
reason; where the key is a valid rollout id that rollout is marked incomplete. Consumption never stalls on one.

Run it in a thread (``start``/``stop``) or as a process::

    python -m transports.kafka.materializer --bootstrap HOST:PORT --topic TOPIC --dir STORE_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from filelock import FileLock, Timeout

from tokcap.durable_io import remove_stale_temp_files
from tokcap.errors import MaterializerFailedError, MaterializerOwnedElsewhereError
from tokcap.store import ApplyResult, TokenCaptureStore
from transports.kafka.admin import list_topics
from transports.kafka.checkpoint import CHECKPOINT_PREFIX, PartitionCheckpoint, write_checkpoints
from transports.kafka.client_errors import AuthenticationWatch, ClientContext, build_client, read_error
from transports.kafka.dead_letters import DEAD_LETTER_PREFIX, REASON_LIMIT, DeadLetterLine, DeadLetterLog
from transports.kafka.delta_parents import ParentRestorer
from transports.kafka.offset_reader import READER_SETTINGS, OffsetReader
from transports.kafka.ownership import write_owner_records
from transports.kafka.router import (
    MATERIALIZER_WRITER,
    ORPHAN_AFTER_OFFSETS,
    ApplyEvent,
    DeadLetter,
    InboundRouter,
    LogMessage,
    Routed,
    carry_out,
)
from transports.kafka.topics import validate_topic_name

# CHECKPOINT_PREFIX, DEAD_LETTER_PREFIX, MATERIALIZER_WRITER and ORPHAN_AFTER_OFFSETS live in their own
# modules now; they stay importable from here.
__all__ = [
    "CHECKPOINT_PREFIX",
    "DEAD_LETTER_PREFIX",
    "MATERIALIZER_WRITER",
    "ORPHAN_AFTER_OFFSETS",
    "OWNER_LOCK_PREFIX",
    "DeadLetterLog",
    "Materializer",
    "PartitionCheckpoint",
    "logger",
    "main",
    "remove_stale_temp_files",
]

logger = logging.getLogger(__name__)

OWNER_LOCK_PREFIX = "kafka-materializer-p"
"""Lock file held by the one materializer applying partition N into a directory: ``kafka-materializer-p<N>.lock``."""

_BATCH_SIZE = 200
_POLL_TIMEOUT_S = 0.2
_RESULTS_KEPT = 10_000


@dataclass
class _PartitionProgress:
    """Runtime state of one partition: its checkpoint, dead letters and replay window."""

    checkpoint: PartitionCheckpoint
    dead_letters: DeadLetterLog
    replay_below: int
    replay_chunks: set[int]
    """Chunk offsets of the checkpoint's open groups that have not been read again yet."""
    written: bytes


def _resolve_waiter(future: asyncio.Future[None]) -> None:
    """Runs on the waiter's loop: wake it unless it already gave up."""
    if not future.done():
        future.set_result(None)


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
    ) -> None:
        """``consumer_factory`` builds the consumer from its settings; tests pass an in-memory topic double.

        ``on_dead_letter`` is called, on the materializer's thread, with each dead-letter line once it is
        written (``tokcap materialize`` prints them); it must not block.
        """
        self._bootstrap = bootstrap_servers
        self._on_dead_letter = on_dead_letter
        self._new_consumer = consumer_factory
        self._topic = validate_topic_name(topic)
        self._store = TokenCaptureStore(store_dir)
        self._requested_partitions = None if partitions is None else sorted(set(partitions))
        self._consumer_config = dict(consumer_config or {})
        self._client = ClientContext(bootstrap_servers, self._consumer_config)
        self._watch = AuthenticationWatch(self._client)
        self._progress: dict[int, _PartitionProgress] = {}
        # Wire deltas whose parent the router no longer keeps (a resume past it) read it again from the log.
        self._parent_reader = OffsetReader(
            lambda: build_client(
                self._new_consumer, {**self._consumer_settings(), **READER_SETTINGS}, self._client, "consumer"
            ),
            self._topic,
        )
        self._router = InboundRouter(parents=ParentRestorer(self._parent_reader.read))
        self._applied_next: dict[int, int] = {}
        self._results: OrderedDict[tuple[int, int], ApplyResult] = OrderedDict()
        self._condition = threading.Condition()
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._async_waiters: list[tuple[int, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # ---------------------------------------------------------------- public

    @property
    def store(self) -> TokenCaptureStore:
        """The store this materializer writes."""
        return self._store

    @property
    def topic(self) -> str:
        """The topic this materializer reads."""
        return self._topic

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
        """The apply result of a recent event at this position, if still remembered."""
        with self._condition:
            return self._results.get((partition, offset))

    def wait_for(self, partition: int, offset: int, timeout_s: float) -> bool:
        """Block until the event at this offset is applied; return ``False`` on timeout."""
        with self._condition:
            applied = self._condition.wait_for(
                lambda: self._failure is not None or self._applied_next.get(partition, 0) > offset, timeout_s
            )
        self._raise_if_failed()
        return bool(applied)

    async def applied(self, partition: int, offset: int, timeout_s: float) -> bool:
        """Wait, without holding a thread, until the event at this offset is applied; ``False`` on timeout.

        Many trainers' freezes wait at once; a blocking wait per freeze would queue them behind the
        event loop's few executor threads.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        waiter = (partition, offset, loop, future)
        with self._condition:
            if self._failure is None and self._applied_next.get(partition, 0) > offset:
                return True
            if self._failure is None:
                self._async_waiters.append(waiter)
        if self._failure is not None:
            self._raise_if_failed()
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            with self._condition:
                if waiter in self._async_waiters:
                    self._async_waiters.remove(waiter)
            return False
        self._raise_if_failed()
        return True

    def _wake_async_waiters(self) -> None:
        """Resolve the waits that are now applied, or all of them when the loop failed; caller holds the condition."""
        still_waiting = []
        for waiter in self._async_waiters:
            partition, offset, loop, future = waiter
            if self._failure is not None or self._applied_next.get(partition, 0) > offset:
                # A closed event loop raises here: nobody is waiting on it any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_resolve_waiter, future)
            else:
                still_waiting.append(waiter)
        self._async_waiters = still_waiting

    def high_watermarks(self, timeout_s: float = 10.0) -> dict[int, int]:
        """Per assigned partition, the offset after the last message currently in the log."""
        consumer = build_client(self._new_consumer, self._consumer_settings(), self._client, "consumer")
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

    def _consumer_settings(self) -> dict[str, Any]:
        return self._client.settings(
            {
                "group.id": f"tokcap-materializer-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "error",
                "error_cb": self._watch,
            },
            defaults={"fetch.wait.max.ms": 100},
        )

    def _partitions(self, consumer: Consumer, timeout_s: float = 30.0) -> list[int]:
        if self._requested_partitions is not None:
            return list(self._requested_partitions)
        metadata = list_topics(consumer, self._watch, self._client, timeout_s, self._topic).topics.get(
            self._topic
        )
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise MaterializerFailedError(
                f"topic {self._topic!r} has no readable partitions ({metadata and metadata.error}); create it first"
            )
        return sorted(metadata.partitions)

    def _raise_if_failed(self) -> None:
        if isinstance(self._failure, MaterializerOwnedElsewhereError):
            raise self._failure
        if self._failure is not None:
            raise MaterializerFailedError(
                f"the materializer of topic {self._topic!r} stopped: {self._failure}"
            ) from self._failure

    def _run_guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            if isinstance(exc, MaterializerOwnedElsewhereError):
                logger.info("%s", exc)
            else:
                logger.exception("materializer of topic %s failed", self._topic)
            with self._condition:
                self._failure = exc
                self._condition.notify_all()
                self._wake_async_waiters()
        finally:
            self._ready.set()

    def _run(self) -> None:
        consumer = build_client(self._new_consumer, self._consumer_settings(), self._client, "consumer")
        try:
            with ExitStack() as held:
                partitions = self._partitions(consumer)
                for partition in partitions:
                    held.enter_context(self._exclusive(partition))
                write_owner_records(self._store.root, self._topic, partitions)
                remove_stale_temp_files(self._store.root)
                self._consume(consumer, partitions)
        finally:
            consumer.close()
            self._parent_reader.close()

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

    def _consume(self, consumer: Consumer, partitions: list[int]) -> None:
        assignment = []
        for partition in partitions:
            checkpoint = PartitionCheckpoint.of_directory(self._store.root, self._topic, partition)
            progress = _PartitionProgress(
                checkpoint=checkpoint,
                dead_letters=DeadLetterLog.of_directory(self._store.root, partition),
                replay_below=checkpoint.next_offset,
                replay_chunks=set(checkpoint.pending_chunk_offsets),
                written=checkpoint.encode(),
            )
            self._progress[partition] = progress
            with self._condition:
                self._applied_next[partition] = checkpoint.next_offset
            assignment.append(TopicPartition(self._topic, partition, checkpoint.resume_offset()))
        consumer.assign(assignment)
        logger.info(
            "materializer ready: topic %s, resuming at %s",
            self._topic,
            {tp.partition: tp.offset for tp in assignment},
        )
        self._ready.set()
        while not self._stop.is_set():
            # Wait for one message, then take what is already fetched: consume(n, t) alone blocks until n
            # messages or t, which delays every freeze by up to t whenever fewer than n messages arrive.
            messages = consumer.consume(1, _POLL_TIMEOUT_S)
            self._watch.raise_if_failed()
            if messages:
                messages.extend(consumer.consume(_BATCH_SIZE - 1, 0))
            # The batch shares one filesystem sync; the checkpoint is written only after it is durable.
            with self._store.deferred_durability():
                for message in messages:
                    self._take(message)
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Write every changed checkpoint atomically, then tell waiters what is applied."""
        changed: dict[int, bytes] = {}
        for partition, progress in self._progress.items():
            # Chunks of the checkpoint's open groups not re-read yet are still open: a batch that read none
            # of this partition must not forget them.
            progress.checkpoint.pending_chunk_offsets = sorted(
                {*self._router.open_chunk_offsets(partition), *progress.replay_chunks}
            )
            encoded = progress.checkpoint.encode()
            if encoded != progress.written:
                changed[partition] = encoded
        write_checkpoints(self._store.root, changed)
        with self._condition:
            for partition, progress in self._progress.items():
                progress.written = changed.get(partition, progress.written)
                self._applied_next[partition] = progress.checkpoint.next_offset
            self._condition.notify_all()
            self._wake_async_waiters()

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
        if offset < progress.replay_below:
            # Processed before the checkpoint; only the chunks of groups open there are needed again.
            if offset in progress.replay_chunks:
                progress.replay_chunks.discard(offset)
                self._router.rebuffer(LogMessage.of(message))
            return
        for routed in self._router.route(LogMessage.of(message)):
            self._carry_out(progress, routed)
        progress.checkpoint.next_offset = offset + 1

    def _on_consumer_error(self, error: KafkaError) -> None:
        failure = read_error(error, topic=self._topic, context=self._client)
        if failure is not None:
            raise failure

    def _carry_out(self, progress: _PartitionProgress, routed: Routed) -> None:
        """Apply one routing decision, remember its verdict, and write the dead-letter line of one that failed."""
        result = carry_out(self._store, self._topic, routed)
        if isinstance(routed, DeadLetter):
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
            if written and self._on_dead_letter is not None:
                self._on_dead_letter(
                    DeadLetterLine(
                        routed.partition, routed.offset, routed.rollout_id, routed.reason[:REASON_LIMIT]
                    )
                )
        if result is not None and (
            isinstance(routed, ApplyEvent) or (isinstance(routed, DeadLetter) and routed.positioned)
        ):
            with self._condition:
                self._results[(routed.partition, routed.offset)] = result
                while len(self._results) > _RESULTS_KEPT:
                    self._results.popitem(last=False)


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
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a materializer process; it stops cleanly, checkpoint written, on SIGINT or SIGTERM."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    partitions = None if args.partitions is None else [int(p) for p in args.partitions.split(",") if p]
    materializer = Materializer(args.bootstrap, args.topic, args.dir, partitions)

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        materializer.request_stop()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        materializer.run_until_stopped()
    except MaterializerFailedError as exc:
        print(f"materializer failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

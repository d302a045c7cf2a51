"""``KafkaTokenSource``: freeze, drop, retire and delete through the log, answered from the store.

Each command is published to the run topic keyed by its rollout, so it lands after every event
of that rollout acknowledged before it. The source then waits until its materializer has applied
the command's offset and answers with what the store decided there.

The materializer runs in a thread of the source's process by default, shared by every source of the
process on the same directory and topic. When another process already materializes the directory, the
source follows that process's checkpoint files and reads verdicts back from the store, and becomes the
owner itself if that process goes away. With ``external_materializer=True`` the source only ever follows
(``tokcap materialize`` feeds the directory).
A following source reads the topic's id after each command is delivered and refuses a checkpoint bound to
another id: the command then sits in a topic created again under the same name, whose offsets mean nothing to
that checkpoint.
Either way a source gets an answer one way: it waits until the command's position is applied, then asks the
answers by position (``tokcap.files.log_answers``): the in-process projection (its memory first) or, following, the
files. The rollout's state records the verdict of every drop, retire and delete at its log position, as it
records each freeze's answer (``rules.recorded_verdict``). Because the decision is taken at a log position,
every replay of the topic reaches the same answer and the same snapshot id.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokcap.errors import ConfigError, DeliveryTimeoutError, RolloutRetiredError
from tokcap.files.layout import RolloutPaths
from tokcap.files.log_answers import FileAnswers, LogAnswers
from tokcap.files.store import ApplyOutcome, ApplyResult, TokenCaptureStore
from tokcap.log.events import DeleteEvent, DropEvent, Event, FreezeEvent, LogPosition, RetireEvent
from tokcap.log.rollout_ids import validate_rollout_id, validate_rollout_ids
from tokcap.metrics import source_timed
from tokcap.protocols import RolloutRemovalPayload, TokenCaptureSnapshot
from transports.kafka.client.admin import TopicIdReader
from transports.kafka.client.producer_bridge import DEFAULT_DELIVERY_TIMEOUT_S, ProducerBridge
from transports.kafka.client.topics import resolve_topic
from transports.kafka.errors import PartitionOwnerMissingError
from transports.kafka.materializer.checkpoint import PartitionCheckpoint, checkpoint_path
from transports.kafka.materializer.incarnation import other_incarnation
from transports.kafka.materializer.loop import Materializer
from transports.kafka.materializer.shared_materializers import shared_materializers
from transports.kafka.private_projection import PROJECTION, PrivateProjection
from transports.kafka.sink import default_writer_id
from transports.kafka.wire.codec import encode_event_messages

__all__ = ["DEFAULT_APPLY_TIMEOUT_S", "KafkaTokenSource"]

DEFAULT_APPLY_TIMEOUT_S = 30.0
"""How long a command waits for the materializer to apply it."""

_CHECKPOINT_POLL_S = 0.01

_OWNER_CHECK_S = 1.0

_INLINE_ANSWER_BYTES = 1 << 20
"""Most bytes of a rollout's entries file whose freeze answer is read from the files on the event loop itself.

A trip to a worker thread waits for a free thread of the default executor, then for the interpreter lock after
each system call; in a process busy with other coroutines that costs tens of milliseconds, far more than reading
a small rollout (the bench's main-load rollout, about 200 KB of entries, reads in about 1 ms). A larger rollout's
answer is read on a thread, so the loop still serves its other coroutines at the interpreter's switches."""
"""How long a following source waits on the owner's checkpoint before checking that the owner still runs."""


class _CheckpointWaiter:
    """Waits for another process's materializer by reading its checkpoint files in the shared directory."""

    def __init__(self, store_dir: Path, topic: str, read_topic_id: Callable[[], str]) -> None:
        self._store_dir = store_dir
        self._topic = topic
        self._read: dict[int, tuple[float, PartitionCheckpoint]] = {}
        self._read_topic_id = read_topic_id
        self._id_lock = threading.Lock()
        self._last_id: tuple[float, str] | None = None
        """The topic's id and when the read that returned it began."""

    def _topic_id_since(self, delivered_at: float) -> str:
        """The topic's id as read after ``delivered_at``: the incarnation a command delivered then sits in.

        Commands delivered before a read began share it, so a burst costs about one request.
        """
        with self._id_lock:
            if self._last_id is None or self._last_id[0] < delivered_at:
                began = time.monotonic()
                self._last_id = (began, self._read_topic_id())
            return self._last_id[1]

    def _checkpoint(self, partition: int, topic_id: str) -> PartitionCheckpoint:
        """The partition's checkpoint, read at most once per poll interval however many commands wait on it."""
        now = time.monotonic()
        kept = self._read.get(partition)
        if kept is None or now - kept[0] >= _CHECKPOINT_POLL_S:
            kept = (now, PartitionCheckpoint.of_directory(self._store_dir, self._topic, partition))
            self._read[partition] = kept
        checkpoint = kept[1]
        if checkpoint.topic_id is not None and checkpoint.topic_id != topic_id:
            raise other_incarnation(
                f"checkpoint {checkpoint_path(self._store_dir, partition)}",
                self._topic,
                checkpoint.topic_id,
                topic_id,
            )
        return checkpoint

    async def applied(self, partition: int, offset: int, timeout_s: float, delivered_at: float) -> bool:
        """Poll the checkpoint without holding a thread; ``False`` when the command is not applied in time.

        A checkpoint bound to another incarnation of the topic than the one the command was delivered to
        is ``TopicIncarnationError``.
        """
        deadline = time.monotonic() + timeout_s
        topic_id = await asyncio.to_thread(self._topic_id_since, delivered_at)
        while not self._checkpoint(partition, topic_id).command_applied(offset):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_CHECKPOINT_POLL_S)
        return True


class KafkaTokenSource:
    """Publishes freeze/drop/retire/delete commands and answers from the materialized store."""

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        store_dir: str | Path | None = None,
        run_id: str | None = None,
        topic: str | None = None,
        materializer: Materializer | None = None,
        external_materializer: bool = False,
        timeout_s: float = DEFAULT_APPLY_TIMEOUT_S,
        writer_id: str | None = None,
        delivery_timeout_s: float = DEFAULT_DELIVERY_TIMEOUT_S,
        producer_config: Mapping[str, Any] | None = None,
        consumer_config: Mapping[str, Any] | None = None,
        owns_partition: Callable[[int], bool] | None = None,
    ) -> None:
        """``owns_partition``, given by a source spanning several directories (``partitioned_source``), says
        whether ``store_dir`` owns a partition: a command that lands on one it does not own is refused at once
        instead of waiting for a checkpoint that never moves.

        Without ``store_dir`` (nor ``materializer``) the projection lives in a directory this process makes for
        itself and removes at ``close`` (``tokcap.files.private_dirs``), shared by this process's sources of the topic.
        """
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        self._topic = resolve_topic(run_id, topic)
        if external_materializer and materializer is not None:
            raise ConfigError("pass either a materializer or external_materializer=True, not both")
        if store_dir is None and external_materializer:
            raise ConfigError("an external materializer writes a directory of its own: pass it as store_dir")
        if store_dir is None and materializer is not None:
            store_dir = materializer.store.root
        self._private = PrivateProjection.take(store_dir, PROJECTION, bootstrap_servers, self._topic)
        store_dir = self._private.store_dir
        if materializer is not None:
            if materializer.topic != self._topic:
                raise ConfigError(
                    f"the materializer reads {materializer.topic!r}, not this source's {self._topic!r}"
                )
            if materializer.store.root.resolve() != Path(store_dir).resolve():
                raise ConfigError(
                    f"the materializer writes {materializer.store.root}, not this source's store_dir {store_dir}"
                )
        self._shares_materializer = materializer is None and not external_materializer
        self._materializer: Materializer | None = materializer
        self._materializer_settings = (bootstrap_servers, self._topic, store_dir, consumer_config)
        if self._shares_materializer:
            try:
                self._materializer = shared_materializers.acquire(*self._materializer_settings)
            except BaseException:
                self._private.release()
                raise
        self._store = (
            self._materializer.store if self._materializer is not None else TokenCaptureStore(store_dir)
        )
        self._files = FileAnswers(self._store)
        self._external: _CheckpointWaiter | None = None
        if self._materializer is None:
            self._external = _CheckpointWaiter(
                Path(store_dir),
                self._topic,
                TopicIdReader(bootstrap_servers, self._topic, client_config=consumer_config),
            )
        self._timeout_s = timeout_s
        self._writer_id = writer_id or default_writer_id()
        self._bridge = ProducerBridge(
            bootstrap_servers, delivery_timeout_s=delivery_timeout_s, producer_config=producer_config
        )
        self._owns_partition = owns_partition
        if self._materializer is not None:
            self._materializer.answer_freezes_for(self._writer_id)
        self._closed = False

    def __repr__(self) -> str:
        """Names the topic only: client settings may hold credentials."""
        return f"KafkaTokenSource(topic={self._topic!r})"

    @property
    def materializer(self) -> Materializer:
        """The in-process materializer whose store answers this source."""
        if self._materializer is None:
            raise ConfigError("this source waits on an external materializer; it has no in-process one")
        return self._materializer

    @property
    def store(self) -> TokenCaptureStore:
        """The materialized store this source answers from."""
        return self._store

    @property
    def _answers(self) -> LogAnswers:
        """Who answers a command once it is applied: the in-process projection, else the followed files."""
        return self._files if self._materializer is None else self._materializer.projection

    async def _command(self, event: Event, what: str) -> ApplyResult:
        """Publish one command, wait until it is applied, and return the store's verdict on it."""
        result, _, _ = await self._command_at(event, what)
        return result

    async def _command_at(
        self, event: Event, what: str
    ) -> tuple[ApplyResult, LogPosition, TokenCaptureSnapshot | None]:
        """Publish one command, wait until it is applied; return the verdict and where it sits in the log.

        A freeze's snapshot comes with it when the verdict had to be read from the files (``None`` otherwise).
        """
        messages = encode_event_messages(event, next_chunk_group=_commands_are_never_chunked)
        (delivered,) = await self._bridge.send(self._topic, messages, what=what)
        delivered_at = time.monotonic()
        if self._owns_partition is not None and not self._owns_partition(delivered.partition):
            raise PartitionOwnerMissingError(
                f"{what} of rollout {event.rollout_id!r} landed on partition {delivered.partition} of "
                f"{self._topic!r}, which {self._store.root} does not own; every producer of the run must use "
                "the partitioner the source computes with (librdkafka's default, consistent_random)"
            )
        await self._wait_applied(
            delivered.partition,
            delivered.offset,
            event.rollout_id,
            what,
            ahead=isinstance(event, FreezeEvent),
            delivered_at=delivered_at,
        )
        position = LogPosition(self._topic, delivered.partition, delivered.offset)
        result = self._answers.verdict_at(event, position, from_files=False)
        if result is not None:
            return result, position, None
        # Not in memory: the files hold it (a state leaves the projection's memory only once written). A small
        # answer is read here; a large one in one trip to a thread, the freeze's snapshot with its verdict.
        if self._answer_reads_little(event):
            from_files, snapshot = self._answer_from_files(event, position)
        else:
            from_files, snapshot = await asyncio.to_thread(self._answer_from_files, event, position)
        return from_files, position, snapshot

    def _answer_reads_little(self, event: Event) -> bool:
        """Whether the answer's read is small enough for the event loop (``_INLINE_ANSWER_BYTES``).

        Every answer reads the rollout's state file; only a freeze's reads its entries too.
        """
        if not isinstance(event, FreezeEvent):
            return True
        try:
            size = os.stat(RolloutPaths.of(self._store.root, event.rollout_id).entries).st_size
        except FileNotFoundError:
            return True
        return size <= _INLINE_ANSWER_BYTES

    def _answer_from_files(
        self, event: Event, position: LogPosition
    ) -> tuple[ApplyResult, TokenCaptureSnapshot | None]:
        """The verdict of a command whose rollout's files hold its position, and a freeze's snapshot with it.

        A retired rollout has no snapshot to read: its freeze is refused by the verdict alone.
        """
        answers = self._answers
        result = answers.verdict_at(event, position)
        assert result is not None, "an applied command has a verdict in the files"
        if not isinstance(event, FreezeEvent) or result.outcome is ApplyOutcome.REJECTED_RETIRED:
            return result, None
        return result, answers.snapshot_at(event.rollout_id, position)

    async def _wait_applied(
        self,
        partition: int,
        offset: int,
        rollout_id: str,
        what: str,
        *,
        ahead: bool = False,
        delivered_at: float | None = None,
    ) -> None:
        """Wait until the command is applied (with ``ahead``, or answered ahead of its apply).

        ``delivered_at`` (``time.monotonic``) is when the broker acknowledged it; by default, now.
        """
        if delivered_at is None:
            delivered_at = time.monotonic()
        deadline = time.monotonic() + self._timeout_s
        applied = False
        while not applied:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._materializer is not None:
                applied = await self._materializer.applied(partition, offset, left, command=True, ahead=ahead)
                break
            assert self._external is not None
            applied = await self._external.applied(partition, offset, min(left, _OWNER_CHECK_S), delivered_at)
            if not applied and self._shares_materializer:
                await asyncio.to_thread(self._take_over_if_owner_left)
        if not applied:
            raise DeliveryTimeoutError(
                f"{what} of rollout {rollout_id!r} was written at partition {partition} offset "
                f"{offset} of {self._topic!r} but not applied within {self._timeout_s} s; "
                "check that the materializer is running and keeping up",
                rollout_id=rollout_id,
            )

    def _take_over_if_owner_left(self) -> None:
        """A followed owner that stopped applying may have gone; become the owner if the directory is free."""
        materializer = shared_materializers.acquire(*self._materializer_settings)
        if materializer is not None:
            self._materializer, self._external = materializer, None

    @source_timed("kafka", "freeze")
    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze a rollout at a log position and return its snapshot; freezing again returns the same one."""
        rollout_id = validate_rollout_id(rollout_id)
        event = FreezeEvent(rollout_id=rollout_id, writer=self._writer_id)
        result, position, snapshot = await self._command_at(event, "freeze")
        if result.outcome is ApplyOutcome.REJECTED_RETIRED:
            raise RolloutRetiredError(
                f"rollout {rollout_id!r} is retired; it cannot be frozen. Delete it before reusing its id",
                rollout_id=rollout_id,
            )
        if snapshot is not None:
            return snapshot
        answers = self._answers
        answer = answers.snapshot_at(rollout_id, position, from_files=False)
        if answer is not None:
            return answer
        # Not in memory: the files hold the snapshot once the freeze's block is flushed, so they are read after
        # that, never before. As of the freeze's position: writes applied after it move the version past it.
        await self._wait_applied(position.partition, position.offset, rollout_id, "freeze")
        answer = await asyncio.to_thread(answers.snapshot_at, rollout_id, position)
        assert answer is not None, "a flushed freeze has its snapshot in the files"
        return answer

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire exactly this snapshot; ``False`` if the rollout changed since it was taken."""
        rollout_id = validate_rollout_id(rollout_id)
        event = DropEvent(
            rollout_id=rollout_id, writer=self._writer_id, snapshot_id=snapshot_id, version=version
        )
        result = await self._command(event, "drop")
        return bool(result.dropped)

    async def _remove(self, events: Sequence[RetireEvent | DeleteEvent], what: str) -> RolloutRemovalPayload:
        results = await asyncio.gather(*(self._command(event, what) for event in events))
        removed = tuple(result.rollout_id for result in results if result.removed)
        not_found = tuple(result.rollout_id for result in results if not result.removed)
        return RolloutRemovalPayload(removed=removed, not_found=not_found)

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove the rollouts' records and keep their fences, whatever their state."""
        ids = validate_rollout_ids(rollout_ids)
        return await self._remove(
            [RetireEvent(rollout_id=rid, writer=self._writer_id) for rid in ids], "retire"
        )

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove the rollouts' records and fences so their ids can be reused."""
        ids = validate_rollout_ids(rollout_ids)
        return await self._remove(
            [DeleteEvent(rollout_id=rid, writer=self._writer_id) for rid in ids], "delete"
        )

    async def close(self) -> None:
        """Stop the producer and hand the shared materializer back (the last source stops it); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._materializer is not None:
            self._materializer.stop_answering_for(self._writer_id)
        await asyncio.to_thread(self._bridge.close)
        if self._shares_materializer and self._materializer is not None:
            await asyncio.to_thread(shared_materializers.release, self._materializer)
        self._private.release()


def _commands_are_never_chunked() -> str:
    raise AssertionError("a command event is far smaller than a chunk")

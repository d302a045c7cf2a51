"""The end of each block: flush the projection, then write the changed checkpoints, then tell the waits.

The checkpoint is written only once its block is durable, so it never passes an event whose effects are not
on disk. What it says is also what the materializer's own sources wait on: a position is applied and durable
when the checkpoint as written says so (``PartitionCheckpoint.command_applied``), the same answer a source in
another process reads from the file.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from tokcap.files.log_projection import Projection
from tokcap.log.events import EventType
from transports.kafka.materializer.checkpoint import PartitionCheckpoint, write_checkpoints
from transports.kafka.materializer.loop_metrics import observe_command_wait, observe_flush
from transports.kafka.materializer.partition_progress import PartitionProgress, durable_copy
from transports.kafka.materializer.schedule import Scheduler
from transports.kafka.materializer.waiters import WaiterRegistry
from transports.kafka.wire.router import InboundRouter

__all__ = ["BlockCheckpoints"]


class BlockCheckpoints:
    """Ends blocks with their checkpoints, and answers which positions those make applied and durable."""

    def __init__(
        self,
        root: Path,
        projection: Projection,
        schedule: Scheduler,
        router: InboundRouter,
        progress: Mapping[int, PartitionProgress],
    ) -> None:
        self._root = root
        self._projection = projection
        self._schedule = schedule
        self._router = router
        self._progress = progress
        self.waiters = WaiterRegistry(self.is_applied, schedule.carried)
        """The waits on positions: applied and durable (``is_applied``), or carried out ahead (the scheduler)."""
        self._durable: dict[int, PartitionCheckpoint] = {}
        """Per partition, the checkpoint last written: what is applied and durable."""
        self._moved: dict[int, float] = {}
        """Per partition, when its checkpoint last moved forward (``time.monotonic``)."""
        self._unanswered: list[tuple[EventType, float]] = []
        """Commands carried out since the last checkpoint and not answered from memory: their type and when
        they were read. Their answer is the checkpoint that makes them durable."""

    def resume(self, partition: int, checkpoint: PartitionCheckpoint) -> None:
        """A partition starts from ``checkpoint``: what it says is applied and durable."""
        self._moved[partition] = time.monotonic()
        with self.waiters.condition:
            self._durable[partition] = durable_copy(checkpoint)

    def unanswered(self, event_type: EventType, read_at: float) -> None:
        """A command whose source waits for the checkpoint was carried out; its wait is observed at the next."""
        self._unanswered.append((event_type, read_at))

    def end_block(self, block: str) -> None:
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
            encoded = progress.next_checkpoint(partition, self._schedule, self._router)
            if encoded is not None:
                changed[partition] = encoded
                self._moved[partition] = time.monotonic()
        write_checkpoints(self._root, changed)
        with self.waiters.condition:
            for partition, progress in self._progress.items():
                if partition in changed:
                    progress.written = changed[partition]
                    self._durable[partition] = durable_copy(progress.checkpoint)
            answered_at = time.monotonic()
            for event_type, read_at in self._unanswered:
                observe_command_wait(event_type, read_at, answered_at)
            self._unanswered.clear()
            self.waiters.applied_moved()

    def is_applied(self, partition: int, offset: int, command: bool) -> bool:
        """Whether this offset and everything before it (for a command: its rollout's events before it) is
        applied and durable, read from the checkpoint as written; the caller holds the condition."""
        durable = self._durable.get(partition)
        if durable is None:
            return False
        return durable.command_applied(offset) if command else durable.next_offset > offset

    def applied_offsets(self) -> dict[int, int]:
        """Per partition, the next offset to apply: every offset below it is applied and checkpointed."""
        with self.waiters.condition:
            return {partition: checkpoint.next_offset for partition, checkpoint in self._durable.items()}

    def age_s(self, partition: int, now: float) -> float:
        """How long ago the partition's checkpoint last moved forward."""
        return now - self._moved.get(partition, now)

"""Where a materializer stands in one partition: its checkpoint, dead letters, replay window and next offset.

The loop keeps one per assigned partition (the scheduler holds the read-ahead). It says what the next
checkpoint is (``next_checkpoint``: the low-water mark, the open chunk groups and the commands carried out
ahead), writes a failed decision's dead-letter line in log order (``record_dead_letter``), and refuses a
fetched offset that does not follow the last one (``out_of_sequence``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from transports.kafka.errors import MaterializerFailedError, OffsetGapError
from transports.kafka.materializer.checkpoint import PartitionCheckpoint
from transports.kafka.materializer.dead_letters import REASON_LIMIT, DeadLetterLine, DeadLetterLog
from transports.kafka.materializer.loop_metrics import count_dead_letter
from transports.kafka.materializer.schedule import Scheduler
from transports.kafka.wire.router import ApplyEvent, DeadLetter, InboundRouter, Routed

__all__ = ["PartitionProgress", "durable_copy", "logger", "out_of_sequence"]

logger = logging.getLogger(__name__)


def durable_copy(checkpoint: PartitionCheckpoint) -> PartitionCheckpoint:
    """A checkpoint as written, kept apart from the one the loop goes on changing."""
    return replace(
        checkpoint,
        pending_chunk_offsets=list(checkpoint.pending_chunk_offsets),
        commands_applied=list(checkpoint.commands_applied),
    )


@dataclass
class PartitionProgress:
    """Runtime state of one partition: its checkpoint, dead letters and replay window."""

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

    @classmethod
    def resuming(cls, root: Path, partition: int, checkpoint: PartitionCheckpoint) -> PartitionProgress:
        """The progress of a partition resumed from ``checkpoint`` in the store directory ``root``."""
        return cls(
            checkpoint=checkpoint,
            dead_letters=DeadLetterLog.of_directory(root, partition),
            replay_below=checkpoint.next_offset,
            replay_chunks=set(checkpoint.pending_chunk_offsets),
            written=checkpoint.encode(),
            fetch_next=checkpoint.resume_offset(),
        )

    def next_checkpoint(self, partition: int, schedule: Scheduler, router: InboundRouter) -> bytes | None:
        """Move the checkpoint to where the loop stands now; its encoding when it changed, else ``None``."""
        head = schedule.low_water(partition)
        if head is not None:
            # The low-water mark: resume re-reads from the first message not fully carried out.
            self.checkpoint.next_offset = head.offset
            open_chunks: Sequence[int] = head.chunks_before
        else:
            self.checkpoint.next_offset = schedule.read_next(partition)
            open_chunks = router.open_chunk_offsets(partition)
        # Chunks of the checkpoint's open groups not re-read yet are still open: a batch that read none
        # of this partition must not forget them.
        self.checkpoint.pending_chunk_offsets = sorted({*open_chunks, *self.replay_chunks})
        next_offset = self.checkpoint.next_offset
        self.checkpoint.commands_applied = sorted(
            offset for offset in schedule.ahead(partition) if offset >= next_offset
        )
        encoded = self.checkpoint.encode()
        return None if encoded == self.written else encoded

    def record_dead_letter(
        self, topic: str, routed: Routed, on_dead_letter: Callable[[DeadLetterLine], object] | None
    ) -> None:
        """Write the dead-letter line of a decision that failed, in log order whenever its mask was applied."""
        if isinstance(routed, ApplyEvent) and routed.offset in self.refused:
            line = DeadLetterLine(
                routed.partition, routed.offset, routed.event.rollout_id, self.refused.pop(routed.offset)
            )
            written_reason = line.reason
        elif isinstance(routed, DeadLetter):
            line = DeadLetterLine(
                routed.partition, routed.offset, routed.rollout_id, routed.reason[:REASON_LIMIT]
            )
            written_reason = routed.reason
        else:
            return
        logger.warning(
            "dead-lettering partition %d offset %d of %s: %s",
            line.partition,
            line.offset,
            topic,
            written_reason,
        )
        written = self.dead_letters.record(line.partition, line.offset, written_reason, line.rollout_id)
        if written:
            count_dead_letter(routed)
        if written and on_dead_letter is not None:
            on_dead_letter(line)


def out_of_sequence(
    topic: str, root: Path, partition: int, expected: int, offset: int
) -> MaterializerFailedError:
    """Why a fetched offset that is not the next one stops the loop: applying on would skip or repeat events."""
    if offset > expected:
        return OffsetGapError(
            f"partition {partition} of topic {topic!r} jumped from offset {expected} to {offset}: "
            f"offsets {expected}-{offset - 1} were deleted (by retention or delete-records) before this "
            f"materializer read them, so {root} cannot hold every event of the run. Replay a "
            "complete copy of the topic into a new directory; docs/operations.md says how to recover"
        )
    return MaterializerFailedError(
        f"partition {partition} of topic {topic!r} went back from offset {expected} to {offset} "
        "under the same topic id: the log was truncated and rewritten (an unclean leader election?), so "
        f"{root} may hold events the topic no longer has. Replay the topic into a new directory"
    )

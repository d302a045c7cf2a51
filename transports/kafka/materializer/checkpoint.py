"""Materializer checkpoints: how far each partition was applied into a store directory.

This is the only module that knows the checkpoint file names. It imports no Kafka client, so
``tokcap inspect`` can read checkpoints without the ``kafka`` extra.

A checkpoint holds ``next_offset`` (every offset below it was processed) and the offsets of the chunks of
chunk groups still open at that point. It is replaced atomically, so a reader sees the old one or the new one.
While commands go ahead of other rollouts' backlog it also lists ``commands_applied``: offsets at or past
``next_offset`` of commands already applied with their rollouts' earlier events, so a source in another process
can answer them; resuming ignores it (the store's per-rollout positions skip what was applied). The key is
written only when the list is not empty, so a caught-up checkpoint has the same bytes as before it existed.

A checkpoint also names the topic's id (``topic_id``), the incarnation of the topic its offsets belong to
(``incarnation``): one read with an expected id is refused when it names another. A checkpoint without the
key (written before it existed) is read as unbound and gets the id the next time it is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from tokcap.errors import StoreCorruptionError
from tokcap.files.durable_io import fsync_directory, replace_atomically
from transports.kafka.errors import MaterializerFailedError
from transports.kafka.materializer.incarnation import check_incarnation

__all__ = [
    "CHECKPOINT_PREFIX",
    "PartitionCheckpoint",
    "applied_next_offset",
    "checkpoint_files",
    "checkpoint_path",
    "command_applied",
    "write_checkpoints",
]

CHECKPOINT_PREFIX = "kafka-checkpoint-p"
"""Checkpoint of partition N: ``kafka-checkpoint-p<N>.json``."""

_SUFFIX = ".json"


def checkpoint_path(directory: Path, partition: int) -> Path:
    """Where partition ``partition``'s checkpoint lives in a store directory."""
    return directory / f"{CHECKPOINT_PREFIX}{partition}{_SUFFIX}"


@dataclass
class PartitionCheckpoint:
    """How far one partition was applied, and which chunk offsets below that still matter."""

    topic: str
    partition: int
    next_offset: int = 0
    pending_chunk_offsets: list[int] = field(default_factory=list)
    commands_applied: list[int] = field(default_factory=list)
    topic_id: str | None = None
    """The id of the topic incarnation these offsets belong to; ``None`` in a checkpoint not bound yet."""

    def resume_offset(self) -> int:
        """Where reading must start: the first open chunk, or the next unprocessed offset."""
        return min([self.next_offset, *self.pending_chunk_offsets])

    def command_applied(self, offset: int) -> bool:
        """Whether the command at this offset is applied, with its rollout's events before it."""
        return self.next_offset > offset or offset in self.commands_applied

    def encode(self) -> bytes:
        """Sorted-key JSON with a trailing newline, identical in every replay."""
        fields: dict[str, object] = {
            "next_offset": self.next_offset,
            "partition": self.partition,
            "pending_chunk_offsets": sorted(self.pending_chunk_offsets),
            "topic": self.topic,
        }
        if self.topic_id is not None:
            fields["topic_id"] = self.topic_id
        if self.commands_applied:
            fields["commands_applied"] = sorted(self.commands_applied)
        return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS) + b"\n"

    @classmethod
    def load(cls, path: Path, topic: str, partition: int, topic_id: str | None = None) -> PartitionCheckpoint:
        """Read a checkpoint; a missing one starts at offset 0, one of another topic is refused.

        With ``topic_id``, one of another incarnation of the topic is refused too (``TopicIncarnationError``),
        and an unbound one is returned bound to ``topic_id``.
        """
        try:
            raw = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            return cls(topic, partition, topic_id=topic_id)
        except orjson.JSONDecodeError as exc:
            raise StoreCorruptionError(
                f"checkpoint {path} is not valid JSON ({exc}); replay into a new directory"
            ) from exc
        if raw.get("topic") != topic or raw.get("partition") != partition:
            raise MaterializerFailedError(
                f"{path} belongs to topic {raw.get('topic')!r} partition {raw.get('partition')!r}, not {topic!r} "
                f"partition {partition}; give each topic its own store directory"
            )
        recorded = raw.get("topic_id")
        recorded = None if recorded is None else str(recorded)
        if topic_id is not None:
            check_incarnation(f"checkpoint {path}", topic, recorded, topic_id)
        return cls(
            topic,
            partition,
            int(raw["next_offset"]),
            [int(o) for o in raw.get("pending_chunk_offsets", [])],
            [int(o) for o in raw.get("commands_applied", [])],
            recorded if recorded is not None else topic_id,
        )

    @classmethod
    def of_directory(
        cls, directory: Path, topic: str, partition: int, topic_id: str | None = None
    ) -> PartitionCheckpoint:
        """The checkpoint of one partition in a store directory (offset 0 when there is none yet)."""
        return cls.load(checkpoint_path(directory, partition), topic, partition, topic_id)


def applied_next_offset(directory: Path, topic: str, partition: int, topic_id: str | None = None) -> int:
    """The next offset a directory's materializer will apply in this partition; everything below is applied."""
    return PartitionCheckpoint.of_directory(directory, topic, partition, topic_id).next_offset


def command_applied(
    directory: Path, topic: str, partition: int, offset: int, topic_id: str | None = None
) -> bool:
    """Whether a directory's materializer applied the command at this offset (with its rollout's events before it)."""
    return PartitionCheckpoint.of_directory(directory, topic, partition, topic_id).command_applied(offset)


def write_checkpoints(directory: Path, encoded: Mapping[int, bytes]) -> None:
    """Replace these partitions' checkpoints atomically, then sync the directory once for all of them."""
    if not encoded:
        return
    for partition, data in encoded.items():
        replace_atomically(checkpoint_path(directory, partition), data, durable=True)
    fsync_directory(directory)


def checkpoint_files(directory: Path) -> list[Path]:
    """Every checkpoint file of a store directory, sorted by name."""
    return sorted(directory.glob(f"{CHECKPOINT_PREFIX}*{_SUFFIX}"))

"""The dead-letter log: one line per message a materializer could not apply, per partition.

This is the only module that knows the dead-letter file names. It imports no Kafka client, so
``tokcap inspect`` can read dead letters without the ``kafka`` extra.

Lines are deduplicated by offset and written in processing order, so a resumed materializer writes
exactly the lines a clean run writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import orjson

from tokcap.files.durable_io import append_durably
from transports.kafka.wire.dead_letter_reason import REASON_LIMIT

__all__ = [
    "DEAD_LETTER_PREFIX",
    "REASON_LIMIT",
    "DeadLetterLine",
    "DeadLetterLog",
    "dead_letter_files",
    "dead_letter_path",
]

DEAD_LETTER_PREFIX = "kafka-dead-letter-p"
"""Dead-letter record of partition N: ``kafka-dead-letter-p<N>.jsonl``."""

_SUFFIX = ".jsonl"


def dead_letter_path(directory: Path, partition: int) -> Path:
    """Where partition ``partition``'s dead letters live in a store directory."""
    return directory / f"{DEAD_LETTER_PREFIX}{partition}{_SUFFIX}"


@dataclass(frozen=True)
class DeadLetterLine:
    """One dead-letter line as written: where the message was, the rollout its key names, and why."""

    partition: int
    offset: int
    rollout_id: str | None
    reason: str

    def describe(self) -> str:
        """One line for an operator: ``partition 0 offset 12 rollout r1: <reason>``."""
        return (
            f"partition {self.partition} offset {self.offset} rollout {self.rollout_id or '-'}: {self.reason}"
        )


class DeadLetterLog:
    """One partition's dead-letter lines; each offset is written at most once."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offsets: set[int] = set()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            with path.open("r+b") as handle:
                handle.truncate(len(complete))
                os.fsync(handle.fileno())
        for line in complete.splitlines():
            self._offsets.add(int(orjson.loads(line)["offset"]))

    @classmethod
    def of_directory(cls, directory: Path, partition: int) -> DeadLetterLog:
        """The dead-letter log of one partition of a store directory."""
        return cls(dead_letter_path(directory, partition))

    def record(self, partition: int, offset: int, reason: str, rollout_id: str | None) -> bool:
        """Append one durable line unless this offset already has one; return whether it was written."""
        if offset in self._offsets:
            return False
        line = orjson.dumps(
            {
                "offset": offset,
                "partition": partition,
                "reason": reason[:REASON_LIMIT],
                "rollout_id": rollout_id,
            },
            option=orjson.OPT_SORT_KEYS,
        )
        append_durably(self._path, line + b"\n")
        self._offsets.add(offset)
        return True


def dead_letter_files(directory: Path) -> list[Path]:
    """Every dead-letter file of a store directory, sorted by name."""
    return sorted(directory.glob(f"{DEAD_LETTER_PREFIX}*{_SUFFIX}"))

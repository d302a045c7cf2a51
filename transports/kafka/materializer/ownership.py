"""Which store directory owns which partition of a run topic, recorded in the directories themselves.

A materializer that takes a partition's lock in a directory writes the partition's owner record there,
``kafka-owner-p<N>.json`` holding the topic, its id (the incarnation of the topic, ``incarnation``) and the
partition. The record stays: the directory keeps the
rollouts of that partition, so it remains the place to read them, across restarts of its materializer.
A source that spans several directories (one per node, say) reads the records to find, for a rollout's
partition, the one directory to wait on and answer from.

Rules:

- one partition has one owner: two directories holding a record for the same partition of a topic are
  refused (``PartitionOwnershipConflictError``), naming both; within one directory the partition lock
  already refuses a second materializer;
- a partition no directory owns is ``PartitionOwnerMissingError``, naming the partition and the directories
  searched; the records are read again on a miss, so a materializer started after the source is found;
- moving a partition to another directory means deleting its record from the old one;
- a record naming another id of the topic is refused (``TopicIncarnationError``): the directory holds a
  deleted topic's rollouts. A record without an id (written before records had one) is rewritten with it.

While it runs, a materializer holds each of its partitions' lock file, ``kafka-materializer-p<N>.lock``
(``hold_partition``): a second one applying the same partition into the directory is refused at start.

Records hold nothing that differs between runs over one topic (its id is the same for all of them), so a
directory written by any number of workers is byte-identical to a clean replay. This module imports no
Kafka client.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import orjson

from tokcap.errors import StoreCorruptionError
from tokcap.files.durable_io import fsync_directory, replace_atomically
from tokcap.files.locks import ExclusiveFile
from transports.kafka.errors import (
    MaterializerOwnedElsewhereError,
    PartitionOwnerMissingError,
    PartitionOwnershipConflictError,
)
from transports.kafka.materializer.incarnation import check_incarnation

__all__ = [
    "OWNER_LOCK_PREFIX",
    "OWNER_PREFIX",
    "PartitionOwners",
    "check_owner_records",
    "hold_partition",
    "owned_partitions",
    "owner_record_files",
    "owner_record_path",
    "write_owner_records",
]

OWNER_PREFIX = "kafka-owner-p"
"""Owner record of partition N: ``kafka-owner-p<N>.json``."""

OWNER_LOCK_PREFIX = "kafka-materializer-p"
"""Lock file held by the one materializer applying partition N into a directory: ``kafka-materializer-p<N>.lock``."""

_RECORD = re.compile(rf"^{re.escape(OWNER_PREFIX)}(\d+)\.json$")


def hold_partition(directory: Path, topic: str, partition: int) -> ExclusiveFile:
    """Hold the partition's lock in this directory until it is released; refused when another holds it.

    Two materializers applying one partition into one directory would corrupt it.
    """
    lock = ExclusiveFile(directory / f"{OWNER_LOCK_PREFIX}{partition}.lock")
    if not lock.acquire():
        raise MaterializerOwnedElsewhereError(
            f"partition {partition} of {topic!r} is already being materialized into {directory} "
            "by another process; stop it, or give this materializer other partitions or another directory"
        )
    return lock


def owner_record_path(directory: Path, partition: int) -> Path:
    """Where the owner record of ``partition`` lives in a store directory."""
    return directory / f"{OWNER_PREFIX}{partition}.json"


def _encode(topic: str, partition: int, topic_id: str | None) -> bytes:
    fields: dict[str, object] = {"partition": partition, "topic": topic}
    if topic_id is not None:
        fields["topic_id"] = topic_id
    return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS) + b"\n"


def _read_record(path: Path) -> dict[str, object] | None:
    """An owner record's fields, ``None`` when there is none; a damaged one is corruption."""
    try:
        raw = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as exc:
        raise StoreCorruptionError(
            f"owner record {path} is not valid JSON ({exc}); delete it and restart that directory's materializer"
        ) from exc
    return raw if isinstance(raw, dict) else {}


def check_owner_records(directory: Path, topic: str, partitions: Iterable[int], topic_id: str) -> None:
    """Refuse when these partitions' records in ``directory`` name another incarnation of ``topic``."""
    for partition in partitions:
        path = owner_record_path(directory, partition)
        raw = _read_record(path)
        if raw is None or raw.get("topic") != topic:
            continue
        recorded = raw.get("topic_id")
        check_incarnation(
            f"owner record {path}", topic, None if recorded is None else str(recorded), topic_id
        )


def write_owner_records(
    directory: Path, topic: str, partitions: Iterable[int], topic_id: str | None = None
) -> None:
    """Record that this directory owns these partitions; the caller holds their locks. Unchanged ones are kept.

    With ``topic_id``, records are bound to that incarnation of the topic; the caller checked them first
    (``check_owner_records``).
    """
    written = False
    for partition in partitions:
        path = owner_record_path(directory, partition)
        data = _encode(topic, partition, topic_id)
        try:
            if path.read_bytes() == data:
                continue
        except FileNotFoundError:
            pass
        replace_atomically(path, data, durable=True)
        written = True
    if written:
        fsync_directory(directory)


def owner_record_files(directory: Path) -> list[Path]:
    """Every owner record of a store directory, sorted by name: what ``tokcap inspect`` lists."""
    try:
        names = [path.name for path in directory.iterdir()]
    except FileNotFoundError:
        return []
    return [directory / name for name in sorted(names) if _RECORD.match(name)]


def owned_partitions(directory: Path, topic: str) -> set[int]:
    """The partitions of ``topic`` this directory holds owner records for (none if it does not exist)."""
    owned: set[int] = set()
    try:
        names = [path.name for path in directory.iterdir()]
    except FileNotFoundError:
        return owned
    for name in names:
        match = _RECORD.match(name)
        if match is None:
            continue
        raw = _read_record(directory / name)
        if raw is None:
            continue
        if raw.get("topic") == topic and raw.get("partition") == int(match.group(1)):
            owned.add(int(match.group(1)))
    return owned


def _incarnations(partition: int, first: Path, second: Path) -> str:
    """What a conflict message adds when the two records name different ids of the topic."""
    ids = []
    for directory in (first, second):
        raw = _read_record(owner_record_path(directory, partition)) or {}
        ids.append(raw.get("topic_id"))
    if ids[0] == ids[1] or None in ids:
        return ""
    return (
        f"their records name topic ids {ids[0]} and {ids[1]}: one directory was fed by a deleted topic of this "
        "name and holds only the old run (move it out of the search); "
    )


class PartitionOwners:
    """Maps each partition of a topic to the one directory that owns it, among the given directories."""

    def __init__(self, topic: str, directories: Sequence[str | Path]) -> None:
        if not directories:
            raise PartitionOwnerMissingError(
                "no store directories were given to look for partition owners in"
            )
        self._topic = topic
        self._directories = [Path(d) for d in directories]
        self._lock = threading.Lock()
        self._owner: dict[int, Path] = {}
        self.refresh()

    @classmethod
    def under(cls, topic: str, parent: str | Path) -> PartitionOwners:
        """The owners among ``parent`` and its immediate subdirectories (one per node on a shared filesystem)."""
        root = Path(parent)
        if not root.is_dir():
            raise PartitionOwnerMissingError(
                f"{root} is not a directory; give the parent of the store directories"
            )
        return cls(topic, [root, *sorted(p for p in root.iterdir() if p.is_dir())])

    @property
    def directories(self) -> list[Path]:
        """The directories searched, in the order given."""
        return list(self._directories)

    def refresh(self) -> dict[int, Path]:
        """Read every directory's owner records again; two owners of one partition are refused."""
        owner: dict[int, Path] = {}
        for directory in self._directories:
            for partition in sorted(owned_partitions(directory, self._topic)):
                other = owner.get(partition)
                if other is not None:
                    raise PartitionOwnershipConflictError(
                        f"partition {partition} of {self._topic!r} is owned by both {other} and {directory}; "
                        f"{_incarnations(partition, other, directory)}one partition has one owner: stop one of "
                        f"their materializers and delete its {owner_record_path(directory, partition).name}, or "
                        "give the materializers disjoint --partitions"
                    )
                owner[partition] = directory
        with self._lock:
            self._owner = owner
        return dict(owner)

    def owner_of(self, partition: int) -> Path:
        """The directory that owns ``partition``; reads the records again before saying none does."""
        with self._lock:
            found = self._owner.get(partition)
        if found is not None:
            return found
        found = self.refresh().get(partition)
        if found is None:
            searched = ", ".join(str(d) for d in self._directories)
            raise PartitionOwnerMissingError(
                f"no materializer owns partition {partition} of {self._topic!r} in {searched}; start one with "
                f"--partitions including {partition} into one of these directories"
            )
        return found

"""The chunk groups a reader holds open, partition by partition: reassembly within the topic's limits.

A value too large for one message arrives as a chunk group (``messages.ChunkHeader``). A group can never
complete, and is abandoned, when the same writer session starts another group (its chunks of one group are
contiguous in its output), when a chunk does not continue it, when its rollout is frozen first, or when it is
still open ``ORPHAN_AFTER_OFFSETS`` offsets after its first chunk. An abandoned group is a dead letter whose
mask marks its rollout incomplete, so no reader trains on part of an event.

Memory is bounded, by the topic's limits (``topic_limits``), which every writer and reader of a topic share.
A group larger than ``max_event_bytes``
is dead-lettered and its rollout masked as soon as its first chunk declares it (``count - 1`` chunks of the
first chunk's length and at least one byte more) or its chunks so far exceed it; nothing more of it is
buffered, and its later chunks are orphans. The open groups of one partition hold at most
``max_open_chunk_bytes`` value bytes; a chunk that would take them past it first abandons the partition's
oldest open groups (``_make_room`` says why). Both limits are per partition, not per router, because every
reader must take the same decision from the same log: the materializer, a resumed materializer, one that
owns a subset of the partitions, and ``tokcap log``/``replay`` read partitions interleaved differently, but
each partition in the same order. A router reading ``P`` partitions thus holds at most
``P * max_open_chunk_bytes`` bytes of chunks.

A ghost group is another rollout's, seen by a reader that passes over that rollout: its bytes are counted,
never kept, so a reader of one rollout takes the budget decisions a reader of them all takes.

The groups only hold chunks and decide what the limits and the writers' sessions make of them; a completed
group is handed back whole (``Reassembled``) for the router to decode.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokcap.errors import EventDecodeError
from tokcap.log.events import IncompleteEvent
from tokcap.log.hashing import sha256_hex
from transports.kafka.wire.decisions import MATERIALIZER_WRITER, Buffered, DeadLetter, Routed, dead_letter
from transports.kafka.wire.messages import ChunkHeader, LogMessage, read_chunk_header, rollout_of_key
from transports.kafka.wire.topic_limits import TOPIC_DEFAULTS, TopicLimits

__all__ = ["ORPHAN_AFTER_OFFSETS", "ChunkGroups", "Reassembled", "logger"]

logger = logging.getLogger("transports.kafka.wire.router")
"""The router's logger, where operators watch for groups the memory limits abandon (docs/operations.md)."""

ORPHAN_AFTER_OFFSETS = 100_000
"""A chunk group still open this many offsets after its first chunk will never complete."""


@dataclass(frozen=True)
class Reassembled:
    """A completed chunk group whose bytes match their digest: one value for the router to decode."""

    key: bytes
    value: bytes
    headers: dict[str, str]
    size: int
    """Bytes of every chunk's key and value, what the event cost on the broker."""


@dataclass
class _OpenGroup:
    """The chunks of one large event received so far.

    A ghost is another rollout's group seen by ``pass_over``: its bytes are counted but not kept, so a reader
    of one rollout takes the budget decisions a reader of them all takes.
    """

    header: ChunkHeader
    key: bytes
    headers: dict[str, str]
    offsets: list[int]
    pieces: list[bytes]
    size: int
    held: int
    """Value bytes of the chunks received, what the reassembled value holds so far."""
    ghost: bool = False


class ChunkGroups:
    """The open chunk groups of every partition a reader routes, and the bytes they hold.

    ``limits`` bound the memory chunks take (module docstring); every reader of a topic must use the topic's
    own (``limits_record``), or they may decide differently about a large group.
    """

    def __init__(
        self, orphan_after_offsets: int = ORPHAN_AFTER_OFFSETS, limits: TopicLimits = TOPIC_DEFAULTS
    ) -> None:
        self.orphan_after_offsets = orphan_after_offsets
        self.limits = limits
        """The topic's limits: the largest reassembled value and the open groups' budget per partition."""
        self._groups: dict[int, dict[str, _OpenGroup]] = {}
        self._held: dict[int, int] = {}
        """Per partition, the value bytes its open groups hold (ghosts' counted too)."""

    def open_chunk_offsets(self, partition: int) -> list[int]:
        """The offsets of every chunk of the partition's open groups: a resume must read them again."""
        return sorted(o for group in self._groups.get(partition, {}).values() for o in group.offsets)

    def open_groups(self) -> list[str]:
        """Chunk groups still waiting for chunks, in every partition (another rollout's seen by ``pass_over``
        excluded)."""
        return sorted(
            name for groups in self._groups.values() for name, group in groups.items() if not group.ghost
        )

    def open_chunk_bytes(self, partition: int) -> int:
        """Value bytes the partition's open groups hold (``max_open_chunk_bytes`` bounds it)."""
        return self._held.get(partition, 0)

    def take(
        self, message: LogMessage, headers: dict[str, str], chunk: ChunkHeader, *, ghost: bool = False
    ) -> tuple[list[Routed], Reassembled | None]:
        """Add a chunk to its group: the decisions it takes, and the group's value once complete (a ghost's, never)."""
        key = message.key or b""
        value = message.value or b""
        size = message.size
        partition = message.partition
        if chunk.index == 0:
            # The same session's older group, the same group id included, can no longer complete.
            abandoned = self._abandon_session(message, chunk)
            declared = (chunk.count - 1) * len(value) + 1
            if declared > self.limits.max_event_bytes:
                why = (
                    f"chunk group {chunk.group} declares at least {declared:,} bytes ({chunk.count} chunks of "
                    f"{len(value):,}), over the maximum event size of {self.limits.max_event_bytes:,} bytes "
                    "(max_event_bytes); none of it is buffered"
                )
                return [*abandoned, self._too_large(message, headers, size, why, ghost)], None
            evicted = self._make_room(message, len(value), None)
            opened = _OpenGroup(chunk, key, headers, [], [], 0, 0, ghost)
            self._open(partition, opened)
            self._add(partition, opened, message.offset, value, size)
            return [
                *abandoned,
                *evicted,
                Buffered(partition, message.offset, headers, size, self._progress(chunk)),
            ], None
        group = self._groups.get(partition, {}).get(chunk.group)
        if group is None:
            why = f"orphaned chunk {chunk.index}/{chunk.count} of group {chunk.group}"
            return [dead_letter(message, headers, size, why)], None
        expected = (len(group.pieces), group.header.count, group.header.digest, group.key)
        if (chunk.index, chunk.count, chunk.digest, key) != expected:
            return [
                *self._abandon(
                    message, group, f"chunk {chunk.index} at offset {message.offset} does not continue it"
                ),
                dead_letter(
                    message,
                    headers,
                    size,
                    f"chunk {chunk.index}/{chunk.count} does not continue group {chunk.group}",
                ),
            ], None
        received = group.held + len(value)
        if received > self.limits.max_event_bytes:
            why = (
                f"its chunks reach {received:,} bytes at chunk {chunk.index} (offset {message.offset}), over the "
                f"maximum event size of {self.limits.max_event_bytes:,} bytes (max_event_bytes)"
            )
            too_large = self._abandon(message, group, why)
            self._log_abandoned(too_large)
            return [
                *too_large,
                dead_letter(
                    message, headers, size, f"chunk {chunk.index}/{chunk.count} of group {chunk.group}: {why}"
                ),
            ], None
        evicted = []
        if self._held[partition] + len(value) > self.limits.max_open_chunk_bytes:
            evicted = self._make_room(message, len(value), group)
        self._add(partition, group, message.offset, value, size)
        if len(group.pieces) < group.header.count:
            buffered = Buffered(partition, message.offset, headers, size, self._progress(chunk))
            return ([*evicted, buffered] if evicted else [buffered]), None
        self._close(partition, group)
        if group.ghost:
            return evicted, None
        whole = b"".join(group.pieces)
        if sha256_hex(whole) != group.header.digest:
            why = f"chunk group {chunk.group} reassembles to a different digest"
            return [*evicted, dead_letter(message, headers, group.size, why)], None
        return evicted, Reassembled(group.key, whole, group.headers, group.size)

    def _open(self, partition: int, group: _OpenGroup) -> None:
        self._groups.setdefault(partition, {})[group.header.group] = group
        self._held[partition] = self._held.get(partition, 0) + group.held

    def _add(self, partition: int, group: _OpenGroup, offset: int, value: bytes, size: int) -> None:
        """Append a chunk to an open group; a ghost keeps its length only."""
        group.offsets.append(offset)
        group.pieces.append(b"" if group.ghost else value)
        group.size += size
        group.held += len(value)
        self._held[partition] += len(value)

    def _close(self, partition: int, group: _OpenGroup) -> None:
        groups = self._groups.get(partition, {})
        if groups.get(group.header.group) is group:
            del groups[group.header.group]
            self._held[partition] -= group.held

    def _make_room(self, message: LogMessage, incoming: int, keep: _OpenGroup | None) -> list[Routed]:
        """Abandon the partition's oldest open groups (not ``keep``) until ``incoming`` more bytes fit the budget.

        Never a silent drop: each abandoned group is a dead letter whose reason says to raise the budget, and
        its rollout is masked, so it is never trained on partial data. The oldest go first because a group
        that has stayed open while newer ones began is the one most likely never to complete (its writer
        died between chunks), whereas the group receiving a chunk has a live writer; refusing the newcomer
        instead would let one stuck group mask every later large event until it goes stale. ``keep`` fits
        alone once the others are gone: it is at most ``max_event_bytes``, and the budget is at least that.
        """
        partition = message.partition
        held = self._held.get(partition, 0)
        if held + incoming <= self.limits.max_open_chunk_bytes:
            return []
        why = (
            f"the open chunk groups of partition {partition} would hold {held + incoming:,} bytes, over the "
            f"budget of {self.limits.max_open_chunk_bytes:,} bytes (max_open_chunk_bytes); the oldest open group is "
            "abandoned first. If writers send many large events at once, run on a topic made with a larger "
            "max_open_chunk_bytes (`tokcap topic create --max-open-chunk-bytes N`)"
        )
        evicted: list[Routed] = []
        for group in sorted(
            self._groups.get(partition, {}).values(), key=lambda open_group: open_group.offsets[0]
        ):
            if self._held[partition] + incoming <= self.limits.max_open_chunk_bytes:
                break
            if group is not keep:
                evicted.extend(self._abandon(message, group, why))
        self._log_abandoned(evicted)
        return evicted

    def _too_large(
        self, message: LogMessage, headers: Mapping[str, str], size: int, why: str, ghost: bool
    ) -> DeadLetter:
        decided = dead_letter(message, headers, size, why)
        if not ghost:
            self._log_abandoned([decided])
        return decided

    @staticmethod
    def _log_abandoned(decided: Sequence[Routed]) -> None:
        """Log the groups the memory limits abandoned: an operator may have to raise a limit."""
        for item in decided:
            if isinstance(item, DeadLetter):
                logger.warning(
                    "chunk group dead-lettered at partition %d offset %d (rollout %s masked): %s",
                    item.partition,
                    item.offset,
                    item.rollout_id,
                    item.reason,
                )

    @staticmethod
    def _progress(chunk: ChunkHeader) -> str:
        return f"chunk {chunk.index + 1}/{chunk.count} of {chunk.group}"

    def _abandon_session(self, message: LogMessage, chunk: ChunkHeader) -> list[Routed]:
        """A writer session began a new group: its older open groups in the partition can never complete."""
        return [
            decided
            for group in list(self._groups.get(message.partition, {}).values())
            if group.header.session == chunk.session
            for decided in self._abandon(
                message, group, f"a new chunk group {chunk.group} of the same writer began"
            )
        ]

    def close_frozen_ghosts(self, partition: int, rollout_id: str) -> None:
        """A freeze passed over closes its rollout's ghost groups, as routing it closes the groups it abandons."""
        for group in list(self._groups.get(partition, {}).values()):
            if group.ghost and rollout_of_key(group.key) == rollout_id:
                self._close(partition, group)

    def rebuffer(self, message: LogMessage, headers: dict[str, str]) -> None:
        """Take back a chunk of a group that was open at the checkpoint; it was checked when first read."""
        header = read_chunk_header(headers)
        if header is None:
            raise EventDecodeError(
                f"checkpointed chunk offset {message.offset} of partition {message.partition} is not a chunk; "
                "the checkpoint does not belong to this topic: replay into a new directory"
            )
        value = message.value or b""
        group = self._groups.get(message.partition, {}).get(header.group)
        if group is None:
            self._open(
                message.partition,
                _OpenGroup(header, message.key or b"", headers, [], [], 0, 0),
            )
            group = self._groups[message.partition][header.group]
        self._add(message.partition, group, message.offset, value, message.size)

    def abandon_frozen(self, message: LogMessage, rollout_id: str) -> list[DeadLetter]:
        """A freeze of ``rollout_id`` read at ``message``: its open groups can never be part of its snapshot."""
        return [
            decided
            for group in list(self._groups.get(message.partition, {}).values())
            if rollout_of_key(group.key) == rollout_id
            for decided in self._abandon(
                message, group, f"its rollout was frozen at offset {message.offset} first"
            )
        ]

    def abandon_stale(self, message: LogMessage) -> list[Routed]:
        return [
            decided
            for group in list(self._groups.get(message.partition, {}).values())
            if message.offset - group.offsets[0] >= self.orphan_after_offsets
            for decided in self._abandon(
                message, group, f"still open {self.orphan_after_offsets} offsets later"
            )
        ]

    def _abandon(self, message: LogMessage, group: _OpenGroup, why: str) -> list[DeadLetter]:
        """Close a group that can never complete, decided while routing ``message``; its rollout is masked.

        A ghost is closed without a decision: its rollout is not this reader's.
        """
        partition = message.partition
        self._close(partition, group)
        if group.ghost:
            return []
        offsets = group.offsets
        where = f"{offsets}" if len(offsets) <= 8 else f"[{offsets[0]}, {offsets[1]}, ..., {offsets[-1]}]"
        reason = (
            f"orphaned chunk group {group.header.group}: {len(group.pieces)} of {group.header.count} chunks "
            f"at offsets {where}; {why}"
        )
        rollout_id = rollout_of_key(group.key)
        mask = (
            None
            if rollout_id is None
            else IncompleteEvent(rollout_id=rollout_id, writer=MATERIALIZER_WRITER, reason=reason)
        )
        return [
            DeadLetter(
                partition,
                group.offsets[0],
                group.headers,
                group.size,
                reason,
                rollout_id,
                mask,
                decided_at=message.offset,
            )
        ]

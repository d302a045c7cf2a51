"""The materializer's scheduler: which routed decision to carry out next, with no Kafka or store I/O inside.

The loop reads and routes messages, hands each one to the scheduler (``add``), and asks it what to carry out:
``commands`` (a source command and its own rollout's earlier decisions, ahead of other rollouts' backlog) or
``sweep`` (messages in log order). Each step it yields is carried out by the loop before the scheduler is
resumed, so the scheduler's state always says what is done. Time comes from an injected clock.

Two invariants make its order safe, and the unit tests check both:

- Per-rollout log order: no decision of a rollout is handed out before an earlier one of the same rollout.
  A rollout's files depend only on its own events and their positions, so every rollout's files end as a
  clean in-order replay leaves them, whatever order rollouts are interleaved in.
- The checkpoint is the low-water mark: ``low_water`` names the first message with a decision not yet
  carried out, so a resume re-reads everything not fully done, and the store skips the events each rollout
  already applied (every rollout has applied a prefix of its own events).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tokcap.log.events import DeleteEvent, DropEvent, FreezeEvent, RetireEvent
from transports.kafka.wire.router import ApplyEvent, Deferred, Routed, rollout_of

__all__ = [
    "COMMANDS",
    "MaterializerCounters",
    "Read",
    "Scheduler",
    "Step",
    "logger",
    "rollout_of",
]

logger = logging.getLogger(__name__)

COMMANDS = (FreezeEvent, DropEvent, RetireEvent, DeleteEvent)
"""The events a source waits on: they go ahead of other rollouts' backlog."""


@dataclass
class MaterializerCounters:
    """What the loop did, for benchmarks and tests: how much work a command skipped by going first."""

    messages_routed: int = 0
    """Messages read at or after the checkpoint and routed."""
    messages_swept: int = 0
    """Messages the in-order sweep finished."""
    commands_ahead: int = 0
    """Commands carried out before every message before them was."""
    decisions_ahead: int = 0
    """Decisions carried out ahead of the sweep: the commands and their rollouts' earlier events."""
    backlog_skipped: int = 0
    """Summed over commands carried out ahead: messages still waiting before each of them when it was."""
    freezes_answered_ahead: int = 0
    """Freezes of in-process sources answered from the projection's memory, ahead of their block's flush."""


@dataclass
class Read:
    """One routed message whose decisions are not all carried out yet."""

    offset: int
    routed: list[Routed | Deferred]
    """Its decisions; the loop replaces a deferred one by what it settles to."""
    done: list[bool]
    chunks_before: tuple[int, ...]
    """The partition's open chunk offsets before this message was routed: a checkpoint here names them."""
    size: int
    timestamp_ms: int | None = None
    """The message's log timestamp: the lag in seconds is the age of the oldest one not applied."""
    read_at: float = 0.0
    """When it was fetched (the loop's clock): a freeze's latency runs from here to its answer."""
    rollouts: list[str | None] = field(default_factory=list)
    """Each decision's rollout, as routed (``rollout_of``)."""


@dataclass(frozen=True, slots=True)
class Step:
    """One decision to take: carry it out (``carry``) unless it was carried out ahead already."""

    partition: int
    read: Read
    index: int
    carry: bool = True


@dataclass
class _Partition:
    """The scheduling state of one partition."""

    read_next: int
    """The next offset to route; everything below it is routed."""
    pending: deque[Read] = field(default_factory=deque)
    """Routed messages in log order, from the first one not fully carried out."""
    by_rollout: dict[str, deque[tuple[Read, int]]] = field(default_factory=dict)
    """Per rollout, its decisions not carried out yet, in log order."""
    commands: deque[tuple[Read, int]] = field(default_factory=deque)
    """Commands read and not carried out yet, in log order."""
    ahead: set[int] = field(default_factory=set)
    """Offsets of commands carried out ahead and not swept yet."""


class Scheduler:
    """Routed messages not yet carried out, per partition, and the order to carry them out in."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        first_command_block: int,
        most_command_block: int,
        decode_first_tokens: int = 0,
    ) -> None:
        """``clock`` gives seconds (monotonic); a sweep step's time bound is measured with it.

        A burst of commands is carried out in blocks: the first holds ``first_command_block`` decisions, each
        next one twice as many up to ``most_command_block``, so the first commands are answered soon and the
        last ones share few syncs. While a source in this process waits on freezes, what was read is decoded
        before it is swept, up to ``decode_first_tokens`` tokens decoded ahead (``decodes_first``; 0: never).
        """
        self._clock = clock
        self._first_block = first_command_block
        self._most_block = most_command_block
        self._command_block = first_command_block
        self._decode_first_tokens = decode_first_tokens
        self._partitions: dict[int, _Partition] = {}
        self._turn = 0
        self.held_messages = 0
        """Messages added and not swept yet."""
        self.held_bytes = 0
        """Their wire bytes."""
        self.counters = MaterializerCounters()
        self._served: Counter[str] = Counter()
        """Writer ids of in-process sources: their freezes are carried out as soon as they are read."""

    # ------------------------------------------------------------- sources served in-process

    def serve(self, writer: str) -> None:
        """Carry this writer's freezes out as soon as they are read (a source in this process waits on them)."""
        self._served[writer] += 1

    def stop_serving(self, writer: str) -> None:
        """Undo one ``serve``; the writer's later freezes wait for their turn among the commands."""
        self._served[writer] -= 1
        if self._served[writer] <= 0:
            del self._served[writer]

    def serves(self, writer: str) -> bool:
        """Whether this writer's freezes are carried out as soon as they are read."""
        return writer in self._served

    def decodes_first(self, decoded_ahead_tokens: int) -> bool:
        """Whether to decode what was read before sweeping it, with this many tokens decoded ahead already.

        A source in this process has its freezes carried out as soon as they are read; sweeping first would
        leave the decoding of its rollouts' puts to the burst of freezes at a round's end, each answer paying
        for its own rollout one after another. Decoding first moves that work before the burst. Past the bound
        the sweep goes first again, so memory stays bounded when the loop falls far behind (a replay answers
        no source and never decodes first).
        """
        return bool(self._served) and decoded_ahead_tokens < self._decode_first_tokens

    def decoded_enough(self, decoded_ahead_tokens: int) -> bool:
        """Whether decoding first has reached its bound, so the sweep goes first."""
        return decoded_ahead_tokens >= self._decode_first_tokens

    # ------------------------------------------------------------- feeding

    def open(self, partition: int, read_next: int) -> None:
        """Schedule a partition whose next message to route is at ``read_next``."""
        self._partitions[partition] = _Partition(read_next)

    def add(self, partition: int, read: Read) -> list[int]:
        """Take one routed message (the partition's next); return the indexes of its commands."""
        state = self._partitions[partition]
        read.rollouts = [rollout_of(decision) for decision in read.routed]
        state.pending.append(read)
        commands = []
        for index, decision in enumerate(read.routed):
            rollout_id = read.rollouts[index]
            if rollout_id is not None:
                state.by_rollout.setdefault(rollout_id, deque()).append((read, index))
            if isinstance(decision, ApplyEvent) and isinstance(decision.event, COMMANDS):
                state.commands.append((read, index))
                commands.append(index)
        state.read_next = read.offset + 1
        self.held_messages += 1
        self.held_bytes += read.size
        self.counters.messages_routed += 1
        return commands

    # ------------------------------------------------------------- asking

    def commands_waiting(self) -> bool:
        """Whether a command waits to be carried out first (one carried out already waits for nothing)."""
        for state in self._partitions.values():
            while state.commands and state.commands[0][0].done[state.commands[0][1]]:
                state.commands.popleft()
            if state.commands:
                return True
        return False

    def commands(self) -> Iterator[Step]:
        """The commands read so far, each preceded by its own rollout's earlier decisions only.

        No command is started once a block's worth of decisions was handed out. Each step is carried out
        before the next is asked for.
        """
        budget = self._command_block
        carried = 0
        for partition, state in self._partitions.items():
            while state.commands and carried < budget:
                read, index = state.commands.popleft()
                for step in self.command(partition, read, index):
                    yield step
                    carried += 1

    def command(self, partition: int, read: Read, index: int) -> Iterator[Step]:
        """One command now, preceded by its own rollout's earlier decisions only; nothing if it is done."""
        if read.done[index]:
            return
        state = self._partitions[partition]
        rollout_id = read.rollouts[index]
        assert rollout_id is not None
        waiting = state.by_rollout[rollout_id]
        while True:
            earlier, earlier_index = waiting.popleft()
            yield Step(partition, earlier, earlier_index)
            earlier.done[earlier_index] = True
            self.counters.decisions_ahead += 1
            if earlier is read and earlier_index == index:
                break
        if not waiting:
            del state.by_rollout[rollout_id]
        state.ahead.add(read.offset)
        backlog = read.offset - state.pending[0].offset
        if backlog:
            self.counters.commands_ahead += 1
            self.counters.backlog_skipped += backlog
        logger.debug(
            "partition %d offset %d: command carried out ahead of %d messages",
            partition,
            read.offset,
            backlog,
        )

    def command_block_done(self) -> bool:
        """After a block of commands: whether more wait (a burst goes on, in a block twice as large)."""
        if self.commands_waiting():
            self._command_block = min(2 * self._command_block, self._most_block)
            return True
        return False

    def end_burst(self) -> None:
        """The loop sweeps again: a burst of commands is over, and the next command block is a first one."""
        self._command_block = self._first_block

    def sweep(self, budget: int, step_s: float | None = None) -> Iterator[Step]:
        """Up to ``budget`` messages in log order, shared between the partitions that have some.

        Every decision of each message is handed out, in order; one carried out ahead comes with ``carry``
        false (only its dead-letter line is due). With ``step_s``, no message is started once that many
        seconds passed since the call, after at least one.
        """
        deadline = None if step_s is None else self._clock() + step_s
        active = [(partition, state) for partition, state in self._partitions.items() if state.pending]
        if not active:
            return
        # Each step starts at the next partition, so a step cut short by its time bound starves none of them.
        first = self._turn % len(active)
        active = active[first:] + active[:first]
        self._turn += 1
        swept = 0
        share = max(1, budget // len(active))
        for partition, state in active:
            for _ in range(min(share, len(state.pending))):
                if swept and deadline is not None and self._clock() > deadline:
                    return
                # It leaves the pending messages (and the low-water mark moves past it) once it is all done.
                read = state.pending[0]
                for index in range(len(read.routed)):
                    if read.done[index]:
                        yield Step(partition, read, index, carry=False)
                        continue
                    rollout_id = read.rollouts[index]
                    if rollout_id is not None:
                        waiting = state.by_rollout[rollout_id]
                        popped = waiting.popleft()
                        assert popped[0] is read and popped[1] == index, "rollout order broken"
                        if not waiting:
                            del state.by_rollout[rollout_id]
                    yield Step(partition, read, index)
                    read.done[index] = True
                state.pending.popleft()
                state.ahead.discard(read.offset)
                self.held_messages -= 1
                self.held_bytes -= read.size
                self.counters.messages_swept += 1
                swept += 1

    # ------------------------------------------------------------- reporting

    def low_water(self, partition: int) -> Read | None:
        """The first message of the partition with a decision not carried out; ``None`` when every one is."""
        pending = self._partitions[partition].pending
        return pending[0] if pending else None

    def read_next(self, partition: int) -> int:
        """The partition's next offset to route."""
        return self._partitions[partition].read_next

    def ahead(self, partition: int) -> set[int]:
        """The offsets of commands carried out ahead and not swept yet: a checkpoint lists them as applied."""
        return set(self._partitions[partition].ahead)

    def carried(self, partition: int, offset: int) -> bool:
        """Whether the decisions at this offset were carried out: swept, or a command carried out ahead.

        In memory: durable once a checkpoint passes them. Safe to ask from another thread.
        """
        state = self._partitions.get(partition)
        if state is None:
            return False
        if offset in state.ahead:
            return True
        try:
            low_water = state.pending[0].offset
        except IndexError:
            low_water = state.read_next
        return offset < low_water

    def pending_messages(self, partition: int) -> int:
        """How many of the partition's messages are not swept yet."""
        return len(self._partitions[partition].pending)

    def rollouts_held(self) -> int:
        """Rollouts with a decision not carried out yet; safe to read from another thread."""
        return sum(len(state.by_rollout) for state in list(self._partitions.values()))

    def oldest_timestamp_ms(self, partition: int) -> int | None:
        """The log timestamp of the oldest message not swept, read while the loop may change it."""
        state = self._partitions.get(partition)
        if state is None:
            return None
        try:
            return state.pending[0].timestamp_ms
        except IndexError:
            return None

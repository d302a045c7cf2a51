"""The apply side of the materializer: carry routed decisions out through the projection, in the scheduler's order.

A decision deferred at routing is decoded when its own rollout needs it (``settled``). Each carried-out decision
is counted, a refused staging event is remembered for its dead-letter line, and a command's source is told:
an in-process source's freeze, carried out as soon as it is read (``command_read``), ends its wait at once
and the projection answers it from memory; any other command waits for the checkpoint of its block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from tokcap.files.log_projection import Projection
from tokcap.log.events import FreezeEvent
from transports.kafka.materializer.apply import carry_out, refused_staging_reason
from transports.kafka.materializer.block_checkpoints import BlockCheckpoints
from transports.kafka.materializer.loop_metrics import count_applied, observe_command_wait, observe_freeze
from transports.kafka.materializer.partition_progress import PartitionProgress
from transports.kafka.materializer.schedule import COMMANDS, Read, Scheduler
from transports.kafka.wire.router import ApplyEvent, Deferred, InboundRouter, Routed

__all__ = ["DecisionApplier"]


class DecisionApplier:
    """Carries a materializer's routed decisions out, one step of the scheduler at a time."""

    def __init__(
        self,
        topic: str,
        projection: Projection,
        router: InboundRouter,
        schedule: Scheduler,
        checkpoints: BlockCheckpoints,
        progress: Mapping[int, PartitionProgress],
    ) -> None:
        self._topic = topic
        self._projection = projection
        self._router = router
        self._schedule = schedule
        self._checkpoints = checkpoints
        self._progress = progress
        self._condition: threading.Condition = checkpoints.waiters.condition

    def settled(self, read: Read, index: int) -> Routed:
        """The decision at ``read``/``index``, decoding it first (and its rollout's earlier ones) if deferred."""
        decision = read.routed[index]
        if isinstance(decision, Deferred):
            decision = self._router.settle(decision)
            read.routed[index] = decision
        return decision

    def apply(self, progress: PartitionProgress, routed: Routed, read: Read) -> None:
        """Carry one routing decision out through the projection."""
        result = carry_out(self._projection, self._topic, routed)
        count_applied(self._projection.state_of, routed, result)
        if isinstance(routed, ApplyEvent) and isinstance(routed.event, FreezeEvent):
            observe_freeze(read.read_at, time.monotonic())
        if result is not None and isinstance(routed, ApplyEvent):
            refused = refused_staging_reason(routed, result)
            if refused is not None:
                progress.refused[routed.offset] = refused
        if isinstance(routed, ApplyEvent) and isinstance(routed.event, COMMANDS):
            event = routed.event
            if not (isinstance(event, FreezeEvent) and self._schedule.serves(event.writer)):
                self._checkpoints.unanswered(event.type, read.read_at)

    def command_read(self, partition: int, read: Read, index: int) -> None:
        """A command was read: an in-process source's freeze is carried out now (its rollout's events first)."""
        decision = read.routed[index]
        assert isinstance(decision, ApplyEvent)
        event = decision.event
        if isinstance(event, FreezeEvent) and self._schedule.serves(event.writer):
            progress = self._progress[partition]
            for step in self._schedule.command(partition, read, index):
                self.apply(progress, self.settled(step.read, step.index), step.read)
            with self._condition:
                self._schedule.counters.freezes_answered_ahead += 1
                observe_command_wait(event.type, read.read_at, time.monotonic())
                self._checkpoints.waiters.answered(decision.partition, decision.offset)

    def carry_out_commands(self) -> None:
        """Carry out a block of the commands read so far, each after its own rollout's earlier decisions only."""
        for step in self._schedule.commands():
            self.apply(self._progress[step.partition], self.settled(step.read, step.index), step.read)

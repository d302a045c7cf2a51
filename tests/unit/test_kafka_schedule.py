"""The materializer's scheduler alone: no broker, no store, no threads, and a clock the test moves.

A "loop" here carries a step out by noting it, and advances the fake clock. Its invariants: no decision of a
rollout is carried out before an earlier one of the same rollout, the checkpoint it offers never passes the
lowest offset with a decision not carried out, and each decision is carried out once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from tokcap.log.events import DropEvent, Event, FreezeEvent, IncompleteEvent, IntentEvent
from transports.kafka.materializer.schedule import Read, Scheduler, Step
from transports.kafka.wire.router import ApplyEvent, DeadLetter, Routed


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    """A scheduler fed by hand, and the order in which its steps were carried out."""

    clock: FakeClock = field(default_factory=FakeClock)
    first_block: int = 4
    most_block: int = 16
    carried: list[tuple[int, int, int]] = field(default_factory=list)
    """(partition, offset, index) of each decision carried out, in order."""
    seconds_per_step: float = 0.0
    reads: dict[tuple[int, int], Read] = field(default_factory=dict)
    next_offset: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scheduler = Scheduler(
            self.clock, first_command_block=self.first_block, most_command_block=self.most_block
        )

    def open(self, *partitions: int) -> None:
        for partition in partitions:
            self.scheduler.open(partition, 0)
            self.next_offset[partition] = 0

    def add(self, partition: int, *events: Event, masked: str | None = None) -> Read:
        """One message: an optional positioned mask of another rollout, then its events."""
        offset = self.next_offset[partition]
        self.next_offset[partition] = offset + 1
        routed: list[Routed] = []
        if masked is not None:
            mask = IncompleteEvent(rollout_id=masked, reason="abandoned")
            routed.append(DeadLetter(partition, offset, {}, 1, "abandoned", masked, mask, True))
        routed.extend(ApplyEvent(event, partition, offset, {}, 1) for event in events)
        read = Read(offset, list(routed), [False] * len(routed), (), 10)
        self.scheduler.add(partition, read)
        self.reads[(partition, offset)] = read
        return read

    def carry(self, step: Step) -> None:
        """What the loop does with a step; the invariants are checked before it is carried out."""
        self.check_low_water()
        if step.carry:
            assert not step.read.done[step.index], "a decision was handed out twice"
            self.carried.append((step.partition, step.read.offset, step.index))
        else:
            assert step.read.done[step.index]
        self.clock.now += self.seconds_per_step

    def commands(self) -> int:
        steps = 0
        for step in self.scheduler.commands():
            self.carry(step)
            steps += 1
        return steps

    def sweep(self, budget: int, step_s: float | None = None) -> int:
        before = self.scheduler.counters.messages_swept
        for step in self.scheduler.sweep(budget, step_s):
            self.carry(step)
        return self.scheduler.counters.messages_swept - before

    def check_low_water(self) -> None:
        """The checkpoint the scheduler offers is at or below the first message with a decision not done."""
        for partition in self.next_offset:
            head = self.scheduler.low_water(partition)
            offered = self.scheduler.read_next(partition) if head is None else head.offset
            not_done = [
                offset for (p, offset), read in self.reads.items() if p == partition and not all(read.done)
            ]
            assert offered <= min(not_done, default=self.next_offset[partition]), (
                partition,
                offered,
                not_done,
            )

    def rollout_order(self) -> dict[str, list[int]]:
        """Per rollout, the offsets of its decisions in the order they were carried out."""
        order: dict[str, list[int]] = {}
        for partition, offset, index in self.carried:
            decision = self.reads[(partition, offset)].routed[index]
            rollout = decision.event.rollout_id if isinstance(decision, ApplyEvent) else decision.rollout_id
            assert rollout is not None
            order.setdefault(rollout, []).append(partition * 1_000_000 + offset * 10 + index)
        return order


def random_history(harness: Harness, seed: int) -> None:
    """Interleaved rollouts on two partitions: intents, masks of other rollouts, freezes and drops."""
    rng = random.Random(seed)
    harness.open(0, 1)
    for _ in range(300):
        partition = rng.randrange(2)
        rollout = f"r{partition}-{rng.randrange(6)}"
        kind = rng.random()
        if kind < 0.15:
            harness.add(partition, FreezeEvent(rollout_id=rollout))
        elif kind < 0.2:
            harness.add(partition, DropEvent(rollout_id=rollout, snapshot_id="s", version=1))
        elif kind < 0.3:
            other = f"r{partition}-{rng.randrange(6)}"
            harness.add(partition, IntentEvent(rollout_id=rollout, model_call_id="c"), masked=other)
        else:
            harness.add(partition, IntentEvent(rollout_id=rollout, model_call_id="c"))


@pytest.mark.parametrize("seed", range(8))
def test_any_mix_of_command_blocks_and_sweeps_keeps_each_rollouts_log_order_and_the_checkpoint_low(
    seed: int,
) -> None:
    harness = Harness()
    random_history(harness, seed)
    rng = random.Random(seed + 100)
    while harness.scheduler.held_messages:
        if harness.scheduler.commands_waiting() and rng.random() < 0.7:
            harness.commands()
            harness.scheduler.command_block_done()
        else:
            harness.sweep(rng.randrange(1, 40))
        harness.check_low_water()
    for rollout, positions in harness.rollout_order().items():
        assert positions == sorted(positions), f"rollout {rollout} carried out out of its log order"
    decisions = sum(len(read.routed) for read in harness.reads.values())
    assert len(harness.carried) == len(set(harness.carried)) == decisions
    assert harness.scheduler.counters.commands_ahead > 0
    for partition in (0, 1):
        assert harness.scheduler.low_water(partition) is None
        assert harness.scheduler.read_next(partition) == harness.next_offset[partition]


def test_a_command_is_carried_out_after_its_own_rollouts_events_only_and_the_checkpoint_stays_behind() -> (
    None
):
    harness = Harness()
    harness.open(0)
    for call in range(5):
        harness.add(0, IntentEvent(rollout_id="backlog", model_call_id=f"c{call}"))
        harness.add(0, IntentEvent(rollout_id="frozen", model_call_id=f"c{call}"))
    freeze = harness.add(0, FreezeEvent(rollout_id="frozen"))
    assert harness.scheduler.commands_waiting()
    harness.commands()
    assert [offset for _, offset, _ in harness.carried] == [1, 3, 5, 7, 9, freeze.offset]
    assert harness.scheduler.low_water(0) is harness.reads[(0, 0)]
    assert harness.scheduler.ahead(0) == {freeze.offset}
    counters = harness.scheduler.counters
    assert (counters.commands_ahead, counters.backlog_skipped, counters.decisions_ahead) == (1, 10, 6)
    assert not harness.scheduler.commands_waiting()
    # The sweep then hands out the rest in log order, and what went ahead only for its dead-letter line.
    assert harness.sweep(100) == 11
    assert [offset for _, offset, _ in harness.carried[6:]] == [0, 2, 4, 6, 8]
    assert harness.scheduler.ahead(0) == set()


def test_a_command_carried_out_on_its_own_is_not_waiting_and_is_not_carried_out_again() -> None:
    harness = Harness()
    harness.open(0)
    harness.add(0, IntentEvent(rollout_id="a", model_call_id="c"))
    freeze = harness.add(0, FreezeEvent(rollout_id="a"))
    for step in harness.scheduler.command(0, freeze, 0):
        harness.carry(step)
    assert not harness.scheduler.commands_waiting()
    assert harness.commands() == 0
    assert list(harness.scheduler.command(0, freeze, 0)) == []


def test_a_command_carried_out_now_takes_its_rollouts_decisions_up_to_it_and_no_other_rollouts() -> None:
    harness = Harness()
    harness.open(0)
    harness.add(0, IntentEvent(rollout_id="a", model_call_id="c0"))
    harness.add(0, IntentEvent(rollout_id="b", model_call_id="c0"))
    harness.add(0, IntentEvent(rollout_id="b", model_call_id="c1"), masked="a")
    freeze = harness.add(0, FreezeEvent(rollout_id="a"))
    harness.add(0, IntentEvent(rollout_id="a", model_call_id="c2"))
    harness.sweep(1)
    for step in harness.scheduler.command(0, freeze, 0):
        harness.carry(step)
    assert harness.carried == [(0, 0, 0), (0, 2, 0), (0, 3, 0)]
    assert harness.scheduler.ahead(0) == {3}
    assert harness.sweep(100) == 4
    assert harness.carried[3:] == [(0, 1, 0), (0, 2, 1), (0, 4, 0)]


def test_a_burst_of_commands_is_carried_out_in_blocks_that_double_up_to_the_most_until_it_ends() -> None:
    harness = Harness(first_block=2, most_block=8)
    harness.open(0)
    for rollout in range(40):
        harness.add(0, FreezeEvent(rollout_id=f"r{rollout}"))
    blocks = []
    while harness.scheduler.commands_waiting():
        blocks.append(harness.commands())
        if not harness.scheduler.command_block_done():
            break
    assert blocks == [2, 4, 8, 8, 8, 8, 2]
    for rollout in range(40, 60):
        harness.add(0, FreezeEvent(rollout_id=f"r{rollout}"))
    # Sweeping alone ends no burst: the loop says when it sweeps again.
    harness.sweep(1)
    assert harness.commands() == 8
    harness.scheduler.end_burst()
    assert harness.commands() == 2


def test_a_sweep_step_starts_no_message_after_its_time_bound_but_always_finishes_one() -> None:
    harness = Harness(seconds_per_step=1.0)
    harness.open(0)
    for call in range(10):
        harness.add(0, IntentEvent(rollout_id="a", model_call_id=f"c{call}"))
    assert harness.sweep(100, step_s=2.5) == 3
    assert harness.sweep(100, step_s=-1.0) == 1
    assert harness.sweep(100, step_s=None) == 6


def test_sweep_steps_share_their_budget_and_take_turns_between_partitions() -> None:
    harness = Harness(seconds_per_step=1.0)
    harness.open(0, 1)
    for call in range(6):
        for partition in (0, 1):
            harness.add(partition, IntentEvent(rollout_id=f"r{partition}", model_call_id=f"c{call}"))
    assert harness.sweep(4) == 4
    assert sorted(p for p, _, _ in harness.carried) == [0, 0, 1, 1]
    harness.carried.clear()
    # Cut short after one message, consecutive steps start at alternate partitions.
    firsts = []
    for _ in range(4):
        harness.sweep(4, step_s=0.0)
        firsts.append(harness.carried[-1][0])
    assert firsts in ([0, 1, 0, 1], [1, 0, 1, 0])

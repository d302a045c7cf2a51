"""The in-order sweep's durable blocks: their size changes how often states are written, never what is written."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from kafka_topic_double import MemoryTopic, materialize
from store_contract import directory_contents, make_entry

import tokcap.files.write_batches as store_module
from tokcap.errors import InvalidInputError
from tokcap.log.events import IntentEvent, PutEvent
from transports.kafka.cli.materializer_process import main
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.settings import DEFAULT_SETTINGS
from transports.kafka.materializer.workers import MaterializerWorkers

OVERRUN = replace(DEFAULT_SETTINGS, sweep_step_s=-1.0)
"""Every sweep step is past its time bound after its first message."""

TOPIC = "tokcap.sweep-blocks-test"
ROLLOUTS = 30
CALLS = 10


def interleaved_topic() -> MemoryTopic:
    """Every rollout's calls interleaved turn by turn, as concurrent agents write them; no commands."""
    topic = MemoryTopic(TOPIC)
    for call in range(CALLS):
        for rollout in range(ROLLOUTS):
            rollout_id = f"r{rollout}"
            topic.publish(IntentEvent(rollout_id=rollout_id, model_call_id=f"c{call}"))
            topic.publish(PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, f"c{call}")))
    return topic


def state_writes_of(topic: MemoryTopic, directory: Path, block_messages: int) -> tuple[int, dict[str, bytes]]:
    """How many state files a catch-up replaced, and every file it left but the locks."""
    real_replace, real_temp = store_module.replace_atomically, store_module.write_temp_sibling
    writes = []

    def counted(path: Path, data: bytes, **options: Any) -> None:
        if path.name.endswith(".state.json"):
            writes.append(path.name)
        real_replace(path, data, **options)

    def counted_temp(path: Path, data: bytes, *, durable: bool) -> Path:
        """A block's states are written beside their files and renamed together at its end."""
        if path.name.endswith(".state.json"):
            writes.append(path.name)
        return real_temp(path, data, durable=durable)

    with (
        mock.patch.object(store_module, "replace_atomically", counted),
        mock.patch.object(store_module, "write_temp_sibling", counted_temp),
    ):
        materialize(topic, directory, block_messages=block_messages)
    files = {name: data for name, data in directory_contents(directory).items() if not name.endswith(".lock")}
    return len(writes), files


def test_larger_sweep_blocks_write_each_state_once_per_block_and_leave_the_same_bytes(tmp_path: Path) -> None:
    topic = interleaved_topic()
    messages = 2 * ROLLOUTS * CALLS
    small, small_files = state_writes_of(topic, tmp_path / "small", block_messages=20)
    large, large_files = state_writes_of(topic, tmp_path / "large", block_messages=messages)
    assert large_files == small_files
    # One block holds the whole log: each rollout's state is written once. A block of 20 messages holds one
    # intent and put of ten rollouts, so a block of 20 writes ten states.
    assert large == ROLLOUTS
    assert small == (messages // 20) * 10
    assert DEFAULT_SETTINGS.block_messages >= 1_000


@pytest.mark.parametrize("block", [0, -5, True, 2.5, "1000"])
def test_a_block_size_that_is_not_a_positive_count_of_messages_is_refused(block: Any, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="block_messages must be a positive number"):
        Materializer("memory", TOPIC, tmp_path, block_messages=block)


def test_the_materializer_process_refuses_a_block_size_of_zero_before_it_connects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--bootstrap", "127.0.0.1:1", "--topic", TOPIC, "--dir", str(tmp_path), "--block-messages", "0"]
    assert main(argv) == 2
    assert "block_messages must be a positive number of messages, got 0" in capsys.readouterr().err


def test_workers_refuse_a_block_size_of_zero_before_any_worker_starts(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="block_messages must be a positive number"):
        MaterializerWorkers("127.0.0.1:1", TOPIC, tmp_path, [0, 1], 2, block_messages=0)
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_step_past_its_time_bound_stops_after_one_message_and_the_files_are_the_same(
    tmp_path: Path,
) -> None:
    """The loop reads again after each step; a step that overran its time ends early, never applying less."""
    import transports.kafka.materializer.loop as materializer_module

    real_sweep = Materializer._sweep
    steps: list[int] = []

    def recorded(self: Materializer, budget: int, deadline: float | None = None) -> int:
        swept = real_sweep(self, budget, deadline)
        steps.append(swept)
        return swept

    with mock.patch.object(Materializer, "_sweep", recorded):
        materialize(interleaved_topic(), tmp_path / "untimed")
        assert max(steps) > 1
        steps.clear()
        with mock.patch.object(materializer_module, "DEFAULT_SETTINGS", OVERRUN):
            materialize(interleaved_topic(), tmp_path / "overran")
    assert steps and max(steps) == 1
    assert sum(steps) == ROLLOUTS * CALLS * 2
    assert directory_contents(tmp_path / "overran") == directory_contents(tmp_path / "untimed")


def test_sweep_steps_cut_short_by_their_time_bound_take_turns_between_partitions(tmp_path: Path) -> None:
    """With every step ending after one message, each partition still advances: none waits for another to empty."""
    import transports.kafka.materializer.loop as materializer_module

    topic = MemoryTopic(TOPIC, partitions=2)
    for call in range(CALLS):
        for rollout in range(4):
            rollout_id = f"r{rollout}"
            partition = rollout % 2
            topic.publish(IntentEvent(rollout_id=rollout_id, model_call_id=f"c{call}"), partition=partition)
    real_sweep = Materializer._sweep
    order: list[int] = []

    def recorded(self: Materializer, budget: int, deadline: float | None = None) -> int:
        before = {p: self._schedule.pending_messages(p) for p in self._progress}
        swept = real_sweep(self, budget, deadline)
        order.extend(p for p in self._progress if self._schedule.pending_messages(p) < before[p])
        return swept

    with (
        mock.patch.object(Materializer, "_sweep", recorded),
        mock.patch.object(materializer_module, "DEFAULT_SETTINGS", OVERRUN),
    ):
        materialize(topic, tmp_path)
    first_half = order[: len(order) // 2]
    assert set(first_half) == {0, 1}, order

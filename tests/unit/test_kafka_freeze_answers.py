"""A freeze of an in-process source is answered from memory as soon as it is read, before anything is flushed.

It is carried out at once (after its own rollout's events only) and answered from the projection's state before
its block reaches the disk. The answer is the one the files give once flushed (``store.snapshot(as_of=...)``),
the store still ends as a clean in-order replay leaves it, and freezes of writers nobody in the process answers
for wait for their checkpoint.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from kafka_topic_double import MemoryTopic, materialize
from store_contract import directory_contents, make_entry

from tests.exact_shape import snapshot_shape
from tokcap.files.log_projection import Projection
from tokcap.log.events import FreezeEvent, IntentEvent, LogPosition, PutEvent
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.waiters import WaiterRegistry

TOPIC = "tokcap.freeze-ahead-test"
TRAINER = "trainer-source"


def files(directory: Path) -> dict[str, bytes]:
    """Every file's bytes by name, locks left out (they hold no state)."""
    return {name: data for name, data in directory_contents(directory).items() if not name.endswith(".lock")}


def rollouts_then_freezes(topic: MemoryTopic, rollouts: int, calls: int) -> dict[str, int]:
    """Rollouts written in lockstep, then all frozen at once (a trainer's batch); the freezes' offsets."""
    for call in range(calls):
        for rollout in range(rollouts):
            rollout_id = f"r{rollout}"
            topic.publish(IntentEvent(rollout_id=rollout_id, model_call_id=f"c{call}"))
            topic.publish(PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, f"c{call}", tokens=5)))
    offsets = {}
    for rollout in range(rollouts):
        (offsets[f"r{rollout}"],) = topic.publish(FreezeEvent(rollout_id=f"r{rollout}", writer=TRAINER))
    return offsets


@contextmanager
def nothing_flushed_until_released() -> Iterator[threading.Event]:
    """Hold every flush back until the test sets the event: nothing reaches the disk or the checkpoint."""
    release = threading.Event()
    real = Projection.flush

    def held(projection: Projection) -> None:
        assert release.wait(60)
        real(projection)

    try:
        with mock.patch.object(Projection, "flush", held):
            yield release
    finally:
        release.set()


def answer_from_memory(materializer: Materializer, rollout_id: str, at: int) -> tuple[Any, Any]:
    """The projection's verdict and snapshot for the freeze at this offset, from memory only."""
    position = LogPosition(TOPIC, 0, at)
    projection = materializer.projection
    return (
        projection.verdict_at(FreezeEvent(rollout_id=rollout_id, writer=TRAINER), position, from_files=False),
        projection.snapshot_at(rollout_id, position, from_files=False),
    )


def test_waited_for_freezes_are_answered_before_anything_is_flushed_and_equal_what_the_files_then_give(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    freezes = rollouts_then_freezes(topic, rollouts=6, calls=4)

    async def freeze_all(release: threading.Event) -> tuple[dict[str, Any], dict[int, int], dict[str, Any]]:
        materializer = Materializer(
            "memory",
            TOPIC,
            tmp_path / "live",
            consumer_factory=topic.consumer,
            topic_id_reader=topic.topic_id,
        )
        materializer.answer_freezes_for(TRAINER)
        materializer.start()
        try:
            answered = await asyncio.gather(
                *(materializer.applied(0, at, 60, command=True, ahead=True) for at in freezes.values())
            )
            assert all(answered)
            applied_then = materializer.applied_offsets()
            ahead = {
                rollout_id: answer_from_memory(materializer, rollout_id, at)
                for rollout_id, at in freezes.items()
            }
            release.set()
            assert await materializer.applied(0, max(freezes.values()), 60)
            later = {
                rollout_id: (
                    answer_from_memory(materializer, rollout_id, at)[0],
                    materializer.store.snapshot(rollout_id, as_of=LogPosition(TOPIC, 0, at)),
                )
                for rollout_id, at in freezes.items()
            }
            return ahead, applied_then, later
        finally:
            release.set()
            materializer.stop()

    with nothing_flushed_until_released() as release:
        ahead, applied_then, later = asyncio.run(freeze_all(release))
    assert applied_then == {0: 0}
    assert ahead == later
    # Exactly, not just ``==``: the answers copy the router's decoded entries without checking each token's type.
    assert {rollout: snapshot_shape(snapshot) for rollout, (_, snapshot) in ahead.items()} == {
        rollout: snapshot_shape(snapshot) for rollout, (_, snapshot) in later.items()
    }
    assert all(len(snapshot.entries) == 4 for _, snapshot in ahead.values())
    assert files(tmp_path / "live") == files(materialize(topic, tmp_path / "replay").store.root)


def test_a_snapshot_answered_from_memory_is_the_same_each_time_it_is_asked_before_the_flush(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    (at,) = rollouts_then_freezes(topic, rollouts=1, calls=2).values()

    async def freeze_twice(release: threading.Event) -> tuple[bool, bool]:
        materializer = Materializer(
            "memory", TOPIC, tmp_path, consumer_factory=topic.consumer, topic_id_reader=topic.topic_id
        )
        materializer.answer_freezes_for(TRAINER)
        materializer.start()
        try:
            assert await materializer.applied(0, at, 60, command=True, ahead=True)
            _, first = answer_from_memory(materializer, "r0", at)
            _, second = answer_from_memory(materializer, "r0", at)
            return first is not None, first == second
        finally:
            release.set()
            materializer.stop()

    with nothing_flushed_until_released() as release:
        assert asyncio.run(freeze_twice(release)) == (True, True)


def test_freezes_of_a_writer_no_source_in_the_process_answers_for_are_not_answered_from_memory(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    freezes = rollouts_then_freezes(topic, rollouts=4, calls=3)

    async def wait_for_all() -> int:
        materializer = Materializer(
            "memory", TOPIC, tmp_path, consumer_factory=topic.consumer, topic_id_reader=topic.topic_id
        )
        materializer.answer_freezes_for("another-source")
        materializer.start()
        try:
            answered = await asyncio.gather(
                *(materializer.applied(0, at, 60, command=True, ahead=True) for at in freezes.values())
            )
            assert all(answered)
            return materializer.counters().freezes_answered_ahead
        finally:
            materializer.stop()

    assert asyncio.run(wait_for_all()) == 0
    assert materialize(topic, tmp_path / "replay").counters().freezes_answered_ahead == 0


def test_each_answer_from_memory_ends_only_its_own_freezes_wait_without_rescanning_every_wait(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    freezes = rollouts_then_freezes(topic, rollouts=40, calls=2)
    checks = []
    real_is_answered = WaiterRegistry._is_answered

    def counted(self: WaiterRegistry, partition: int, offset: int, command: bool, ahead: bool) -> bool:
        checks.append(offset)
        return real_is_answered(self, partition, offset, command, ahead)

    async def wait_all(release: threading.Event) -> tuple[list[bool], bool, int]:
        materializer = Materializer(
            "memory", TOPIC, tmp_path, consumer_factory=topic.consumer, topic_id_reader=topic.topic_id
        )
        materializer.answer_freezes_for(TRAINER)
        # Every wait begins before anything is read: the answers arrive while all of them are waiting.
        ahead = [
            asyncio.ensure_future(materializer.applied(0, at, 60, command=True, ahead=True))
            for at in freezes.values()
        ]
        applied = [asyncio.ensure_future(materializer.applied(0, at, 60)) for at in freezes.values()]
        await asyncio.sleep(0)
        checks.clear()
        materializer.start()
        try:
            answered = await asyncio.gather(*ahead)
            checks_while_answering = len(checks)
            # An answer from memory ends no wait for the apply itself: those wait until the block is flushed.
            still_waiting = not any(wait.done() for wait in applied)
            release.set()
            assert all(await asyncio.gather(*applied))
            return answered, still_waiting, checks_while_answering
        finally:
            release.set()
            materializer.stop()

    with (
        mock.patch.object(WaiterRegistry, "_is_answered", counted),
        nothing_flushed_until_released() as release,
    ):
        answered, still_waiting, checks_while_answering = asyncio.run(wait_all(release))
    assert all(answered) and still_waiting
    # 80 waits and 40 answers: rescanning every wait at each answer would check 3,200 times.
    assert checks_while_answering <= 2 * 80

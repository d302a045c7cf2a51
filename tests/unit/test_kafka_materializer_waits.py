"""A source's wait on the in-process materializer: it resumes one loop turn after its answer, or gives up cleanly.

The materializer is not started: the answer is posted by hand, as its thread posts it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kafka_topic_double import MemoryTopic
from loop_turns import turns_until

from transports.kafka.materializer import Materializer

TOPIC = "tokcap.waits-test"


def test_a_waiting_source_resumes_within_two_loop_turns_of_its_answer(tmp_path: Path) -> None:
    materializer = Materializer("memory", TOPIC, tmp_path, consumer_factory=MemoryTopic(TOPIC).consumer)

    async def scenario() -> int:
        wait = asyncio.ensure_future(materializer.applied(0, 5, 60, command=True, ahead=True))
        await asyncio.sleep(0)  # the source now waits
        waiters = materializer._waiters
        with waiters.condition:
            (future,) = list(waiters._async_waiters)
            waiters._resolve(future)  # what the materializer's thread does once the freeze is answered
        turns = await turns_until(wait)
        assert wait.result() is True
        return turns

    # Through wait_for it took three: the answer, wait_for's callback, then the source.
    assert asyncio.run(scenario()) <= 2


def test_a_wait_past_its_bound_returns_false_and_forgets_its_waiter(tmp_path: Path) -> None:
    materializer = Materializer("memory", TOPIC, tmp_path, consumer_factory=MemoryTopic(TOPIC).consumer)

    async def scenario() -> bool:
        return await materializer.applied(0, 5, 0.01, command=True, ahead=True)

    assert asyncio.run(scenario()) is False
    assert not materializer._waiters._async_waiters
    assert not materializer._waiters._ahead_waiters

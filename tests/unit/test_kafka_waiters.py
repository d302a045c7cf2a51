"""The waiter registry alone: waits on positions end when the state they wait for is reached, and only then.

No broker and no materializer: the "applied" state is a dict the test changes, as the loop changes its own,
under the registry's condition.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from transports.kafka.materializer.waiters import WaiterRegistry


@dataclass
class Progress:
    """What a loop would report: every offset below ``applied_next`` is applied; some freezes answered ahead."""

    applied_next: dict[int, int] = field(default_factory=dict)
    commands_applied: set[tuple[int, int]] = field(default_factory=set)
    answered_ahead: set[tuple[int, int]] = field(default_factory=set)

    def is_applied(self, partition: int, offset: int, command: bool) -> bool:
        if self.applied_next.get(partition, 0) > offset:
            return True
        return command and (partition, offset) in self.commands_applied

    def is_answered_ahead(self, partition: int, offset: int) -> bool:
        return (partition, offset) in self.answered_ahead


def registry_of(progress: Progress) -> WaiterRegistry:
    return WaiterRegistry(progress.is_applied, progress.is_answered_ahead)


def test_async_waits_end_once_their_offset_is_applied_and_not_before() -> None:
    progress = Progress()
    waiters = registry_of(progress)

    async def scenario() -> tuple[bool, bool, bool]:
        near = asyncio.ensure_future(waiters.wait_async(0, 3, 60))
        far = asyncio.ensure_future(waiters.wait_async(0, 9, 60))
        await asyncio.sleep(0)
        with waiters.condition:
            progress.applied_next[0] = 4
            waiters.applied_moved()
        assert await near
        await asyncio.sleep(0.01)
        far_done = far.done()
        with waiters.condition:
            progress.applied_next[0] = 10
            waiters.applied_moved()
        return near.result(), far_done, await far

    near, far_done_early, far = asyncio.run(scenario())
    assert near and far and not far_done_early
    assert waiters.waiting() == 0


def test_a_command_wait_ends_when_its_command_is_applied_ahead_of_the_backlog() -> None:
    progress = Progress()
    waiters = registry_of(progress)

    async def scenario() -> tuple[bool, bool]:
        command = asyncio.ensure_future(waiters.wait_async(0, 5, 60, command=True))
        plain = asyncio.ensure_future(waiters.wait_async(0, 5, 0.05))
        await asyncio.sleep(0)
        with waiters.condition:
            progress.commands_applied.add((0, 5))
            waiters.applied_moved()
        return await command, await plain

    assert asyncio.run(scenario()) == (True, False)


def test_a_wait_already_answered_returns_at_once_without_being_registered() -> None:
    progress = Progress(applied_next={0: 10})
    waiters = registry_of(progress)
    assert asyncio.run(waiters.wait_async(0, 9, 60))
    assert waiters.waiting() == 0


def test_a_wait_that_times_out_returns_false_and_is_forgotten() -> None:
    waiters = registry_of(Progress())

    async def scenario() -> tuple[bool, bool]:
        return await waiters.wait_async(0, 5, 0.01), await waiters.wait_async(0, 6, 0.01, ahead=True)

    assert asyncio.run(scenario()) == (False, False)
    assert waiters.waiting() == 0
    assert not waiters._ahead_waiters


def test_waking_a_wait_whose_event_loop_is_closed_does_not_raise_and_forgets_it() -> None:
    progress = Progress()
    waiters = registry_of(progress)
    loop = asyncio.new_event_loop()
    task = loop.create_task(waiters.wait_async(0, 5, 60))
    loop.run_until_complete(asyncio.sleep(0))
    assert waiters.waiting() == 1
    loop.close()
    with waiters.condition:
        progress.applied_next[0] = 6
        waiters.applied_moved()
    assert waiters.waiting() == 0
    assert not task.done()


def test_a_failure_wakes_every_async_and_blocking_wait_and_is_kept() -> None:
    waiters = registry_of(Progress())
    failure = RuntimeError("the loop stopped")
    blocked: list[bool] = []
    thread = threading.Thread(target=lambda: blocked.append(waiters.wait(0, 5, 60)), daemon=True)

    async def scenario() -> list[bool]:
        waits = [
            asyncio.ensure_future(waiters.wait_async(0, 5, 60)),
            asyncio.ensure_future(waiters.wait_async(1, 7, 60, command=True)),
            asyncio.ensure_future(waiters.wait_async(0, 8, 60, command=True, ahead=True)),
        ]
        await asyncio.sleep(0)
        thread.start()
        await asyncio.sleep(0.05)
        waiters.fail(failure)
        return list(await asyncio.wait_for(asyncio.gather(*waits), 5))

    assert asyncio.run(scenario()) == [True, True, True]
    thread.join(5)
    assert blocked == [True]
    assert waiters.failure is failure
    assert waiters.waiting() == 0
    # A wait that begins after the failure returns at once: nothing will answer it.
    assert asyncio.run(waiters.wait_async(0, 99, 60))


def test_a_blocking_wait_ends_when_its_offset_is_applied() -> None:
    progress = Progress()
    waiters = registry_of(progress)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(waiters.wait(0, 5, 60)), daemon=True)
    thread.start()
    thread.join(0.05)
    assert not result
    with waiters.condition:
        progress.applied_next[0] = 6
        waiters.applied_moved()
    thread.join(5)
    assert result == [True]
    assert waiters.wait(0, 6, 0.01) is False


def test_an_answer_ahead_ends_only_the_ahead_waits_at_its_own_position() -> None:
    progress = Progress()
    waiters = registry_of(progress)

    async def scenario() -> tuple[bool, bool, bool]:
        ahead_here = asyncio.ensure_future(waiters.wait_async(0, 5, 60, command=True, ahead=True))
        ahead_elsewhere = asyncio.ensure_future(waiters.wait_async(0, 6, 60, command=True, ahead=True))
        applied_here = asyncio.ensure_future(waiters.wait_async(0, 5, 60, command=True))
        await asyncio.sleep(0)
        with waiters.condition:
            progress.answered_ahead.add((0, 5))
            waiters.answered(0, 5)
        assert await ahead_here
        await asyncio.sleep(0.01)
        return ahead_here.result(), ahead_elsewhere.done(), applied_here.done()

    assert asyncio.run(scenario()) == (True, False, False)
    assert waiters.waiting() == 2
    assert list(waiters._ahead_waiters) == [(0, 6)]

"""The store's writer thread: batches share one barrier, and nobody hears "done" before it."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.factories import make_entry
from tokcap.errors import RolloutFrozenError
from tokcap.files.store import TokenCaptureStore
from tokcap.files.write_queue import MAX_BATCH, WriteQueue


class Recorder:
    """Runs operations and barriers while recording their order."""

    def __init__(self, failing_barrier: bool = False) -> None:
        self.events: list[str] = []
        self.lock = threading.Lock()
        self.failing_barrier = failing_barrier

    def run(self, function: Any, args: tuple[Any, ...]) -> Any:
        return function(*args)

    def barrier(self) -> None:
        with self.lock:
            self.events.append("barrier")
        if self.failing_barrier:
            raise OSError(5, "sync failed")

    def op(self, name: str) -> str:
        with self.lock:
            self.events.append(name)
        return name

    def held_op(self, name: str, running: threading.Event, release: threading.Event) -> str:
        """An operation that says when it runs and finishes only when the test releases it."""
        running.set()
        assert release.wait(30), "the test never released the held operation"
        return self.op(name)


async def queue_behind_a_held_operation(
    queue: WriteQueue, recorder: Recorder, submit_rest: Callable[[], list[asyncio.Future[Any]]]
) -> None:
    """Hold the writer thread in a first operation while ``submit_rest`` queues more, then let it go."""
    running, release = threading.Event(), threading.Event()
    held = asyncio.ensure_future(queue.submit(recorder.held_op, "held", running, release))
    assert await asyncio.to_thread(running.wait, 30)
    rest = submit_rest()
    await asyncio.sleep(0)  # one pass of the loop: every submit above has queued its operation
    release.set()
    await asyncio.gather(held, *rest)


def test_every_operation_completes_only_after_a_barrier_that_followed_it() -> None:
    recorder = Recorder()
    queue = WriteQueue(recorder.run, recorder.barrier, name="test-writer")
    completed: list[tuple[str, int]] = []

    async def one(name: str) -> None:
        await queue.submit(recorder.op, name)
        with recorder.lock:
            completed.append((name, len(recorder.events)))

    async def main() -> None:
        await queue_behind_a_held_operation(
            queue, recorder, lambda: [asyncio.ensure_future(one(f"op{n}")) for n in range(100)]
        )

    asyncio.run(main())
    queue.close()
    assert len(completed) == 100
    for name, seen in completed:
        ran_at = recorder.events.index(name)
        assert "barrier" in recorder.events[ran_at:seen], f"{name} completed before a barrier covered it"
    assert recorder.events.count("barrier") == 1 + math.ceil(100 / MAX_BATCH), "queued operations not batched"
    assert queue.batches == recorder.events.count("barrier")


def test_an_operation_error_reaches_its_own_caller_only() -> None:
    recorder = Recorder()
    queue = WriteQueue(recorder.run, recorder.barrier, name="test-writer")

    def boom() -> None:
        raise ValueError("this one failed")

    async def main() -> list[Any]:
        return await asyncio.gather(
            queue.submit(recorder.op, "a"),
            queue.submit(boom),
            queue.submit(recorder.op, "b"),
            return_exceptions=True,
        )

    results = asyncio.run(main())
    queue.close()
    assert results[0] == "a" and results[2] == "b"
    assert isinstance(results[1], ValueError)


def test_a_failed_barrier_fails_every_operation_of_its_batch() -> None:
    recorder = Recorder(failing_barrier=True)
    queue = WriteQueue(recorder.run, recorder.barrier, name="test-writer")

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(queue.submit(recorder.op, f"op{n}") for n in range(5)), return_exceptions=True
        )

    results = asyncio.run(main())
    queue.close()
    assert all(isinstance(result, OSError) for result in results)


def test_an_urgent_operation_runs_before_queued_ones_in_a_batch_of_its_own() -> None:
    recorder = Recorder()
    queue = WriteQueue(recorder.run, recorder.barrier, name="test-writer")

    def submit_rest() -> list[asyncio.Future[Any]]:
        writes = [asyncio.ensure_future(queue.submit(recorder.op, f"w{n}")) for n in range(MAX_BATCH * 2)]
        return [*writes, asyncio.ensure_future(queue.submit(recorder.op, "freeze", urgent=True))]

    asyncio.run(queue_behind_a_held_operation(queue, recorder, submit_rest))
    queue.close()
    events = recorder.events
    assert events[:4] == ["held", "barrier", "freeze", "barrier"]
    assert events[4:] == [
        *[f"w{n}" for n in range(MAX_BATCH)],
        "barrier",
        *[f"w{n}" for n in range(MAX_BATCH, 2 * MAX_BATCH)],
        "barrier",
    ]


def test_close_finishes_queued_work_and_a_later_submit_restarts_the_thread(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)

    async def main() -> None:
        await asyncio.gather(*(store.put(make_entry("r", f"c{n}")) for n in range(10)))
        await store.close()
        await store.close()
        await store.put(make_entry("r", "after-close"))
        await store.close()

    asyncio.run(main())
    assert len(store.read_entries("r")) == 11


def test_store_errors_keep_their_type_through_the_writer_thread(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)

    async def main() -> None:
        await store.put(make_entry("r", "c1"))
        await store.freeze("r")
        with pytest.raises(RolloutFrozenError):
            await store.put(make_entry("r", "late"))
        await store.close()

    asyncio.run(main())


def test_an_urgent_operation_arriving_mid_batch_runs_next_and_shares_that_batchs_one_barrier() -> None:
    recorder = Recorder()
    queue = WriteQueue(recorder.run, recorder.barrier, name="test-writer")

    async def main() -> None:
        running, release = threading.Event(), threading.Event()
        writes: list[asyncio.Future[Any]] = []

        def submit_batch() -> list[asyncio.Future[Any]]:
            writes.append(asyncio.ensure_future(queue.submit(recorder.held_op, "w0", running, release)))
            writes.extend(asyncio.ensure_future(queue.submit(recorder.op, f"w{n}")) for n in range(1, 6))
            return []

        await queue_behind_a_held_operation(queue, recorder, submit_batch)
        assert await asyncio.to_thread(running.wait, 30)
        freezes = [asyncio.ensure_future(queue.submit(recorder.op, f"f{n}", urgent=True)) for n in range(3)]
        await asyncio.sleep(0)  # the freezes are queued while w0 runs
        release.set()
        await asyncio.gather(*freezes, *writes)

    asyncio.run(main())
    queue.close()
    events = recorder.events
    assert events[:3] == ["held", "barrier", "w0"]
    assert sorted(events[3:6]) == ["f0", "f1", "f2"], "the freezes run right after the running write"
    assert events[6:] == ["barrier", *[f"w{n}" for n in range(1, 6)], "barrier"]


def test_a_batch_wakes_its_callers_loop_once_and_resumes_them_in_queue_order() -> None:
    recorder = Recorder()
    queue = WriteQueue(recorder.run, recorder.barrier, name="test-writer")
    resumed: list[str] = []
    wakeups: list[int] = []

    async def one(name: str) -> None:
        await queue.submit(recorder.op, name)
        resumed.append(name)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(callback, "__module__", None) == "tokcap.files.write_queue":
                wakeups.append(1)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        names = [f"op{n}" for n in range(MAX_BATCH)]
        await queue_behind_a_held_operation(
            queue, recorder, lambda: [asyncio.ensure_future(one(name)) for name in names]
        )

    asyncio.run(main())
    queue.close()
    assert queue.batches == 2
    assert len(wakeups) == queue.batches, "each batch must wake its callers' loop once, not once per caller"
    assert resumed == [f"op{n}" for n in range(MAX_BATCH)]

"""One writer thread per store for async callers: operations run in batches that share one sync.

Dozens of threads each running one store operation spend most of their CPU handing Python's global
interpreter lock back and forth; on two cores that cost more than the file work itself.
A single writer thread takes every queued operation, runs them one after another, makes the whole batch
durable with one barrier, and only then completes each caller's future with its result or its error.
No caller is told "done" before its writes are durable, and a failed sync fails every operation it covered.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["MAX_BATCH", "WriteQueue", "logger"]

logger = logging.getLogger(__name__)

MAX_BATCH = 32
"""Most operations one batch runs before its barrier: bounds how long a caller waits for the others' work.

A batch of 32 puts costs about 10 ms of CPU; syncing every 32 operations is far below the disk's sync rate.
A freeze does not wait for a batch of puts to finish: after the running operation, the waiting urgent
operations (up to 32 more) run in the same batch, and one barrier closes it.
"""

_Result = TypeVar("_Result")


@dataclass
class _Operation(Generic[_Result]):
    """One queued call and where its outcome goes."""

    function: Callable[..., _Result]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[_Result]
    urgent: bool = False
    result: Any = None
    error: BaseException | None = None


def _settle(operations: list[_Operation[Any]]) -> None:
    """Runs on the callers' loop: complete each future unless its caller gave up on it."""
    for operation in operations:
        if operation.future.done():
            continue
        if operation.error is not None:
            operation.future.set_exception(operation.error)
        else:
            operation.future.set_result(operation.result)


class WriteQueue:
    """Runs submitted operations on one thread, in batches closed by one durability barrier.

    ``run_deferred`` runs one operation without its own barrier; ``barrier`` makes everything written durable.
    Both are supplied by the store, which keeps the durability rules in one place.
    """

    def __init__(
        self,
        run_deferred: Callable[[Callable[..., Any], tuple[Any, ...]], Any],
        barrier: Callable[[], None],
        name: str,
    ) -> None:
        self._run_deferred = run_deferred
        self._barrier = barrier
        self._name = name
        self._pending: deque[_Operation[Any]] = deque()
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.batches = 0

    async def submit(self, function: Callable[..., _Result], *args: Any, urgent: bool = False) -> _Result:
        """Queue one operation and wait until it ran and its writes are durable.

        An urgent operation (a trainer's freeze) goes ahead of queued ones. When it arrives during a batch of
        other operations, it runs right after the running one, in that batch (the operations the batch did not
        run yet go back to the queue), so it waits for at most the operation already running, other urgent
        ones and the batch's one barrier.
        """
        loop = asyncio.get_running_loop()
        operation: _Operation[_Result] = _Operation(function, args, loop, loop.create_future(), urgent)
        with self._condition:
            if urgent:
                self._pending.appendleft(operation)
            else:
                self._pending.append(operation)
            if self._thread is None or not self._thread.is_alive():
                self._closing = False
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._condition.notify()
        return await operation.future

    def close(self) -> None:
        """Finish what is queued, then stop the thread; a later ``submit`` starts a new one."""
        with self._condition:
            self._closing = True
            thread = self._thread
            self._condition.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _next_batch(self) -> list[_Operation[Any]] | None:
        with self._condition:
            while not self._pending:
                if self._closing:
                    self._thread = None
                    return None
                self._condition.wait()
            batch: list[_Operation[Any]] = []
            urgent_only = self._pending[0].urgent
            while self._pending and len(batch) < MAX_BATCH and (self._pending[0].urgent or not urgent_only):
                batch.append(self._pending.popleft())
            return batch

    def _urgent_waiting(self) -> bool:
        with self._condition:
            return bool(self._pending) and self._pending[0].urgent

    def _requeue(self, operations: list[_Operation[Any]]) -> None:
        """Put operations a batch did not run back, in order, behind the urgent ones and ahead of the rest."""
        with self._condition:
            index = 0
            while index < len(self._pending) and self._pending[index].urgent:
                index += 1
            for offset, operation in enumerate(operations):
                self._pending.insert(index + offset, operation)

    def _take_urgent(self) -> list[_Operation[Any]]:
        """Take the urgent operations at the front of the queue, at most ``MAX_BATCH``."""
        with self._condition:
            taken: list[_Operation[Any]] = []
            while self._pending and self._pending[0].urgent and len(taken) < MAX_BATCH:
                taken.append(self._pending.popleft())
            return taken

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            index = 0
            while index < len(batch):
                operation = batch[index]
                if index and not operation.urgent and self._urgent_waiting():
                    # A freeze arrived: run the urgent operations next, in this batch, and close it with one
                    # barrier for all, instead of a barrier for the operations already run and another for the
                    # freezes. The operations not run yet go back to the front of the queue, behind any urgent.
                    self._requeue(batch[index:])
                    batch = batch[:index] + self._take_urgent()
                    continue
                try:
                    operation.result = self._run_deferred(operation.function, operation.args)
                except BaseException as exc:  # handed to the caller, never swallowed
                    operation.error = exc
                index += 1
            try:
                self._barrier()
            except BaseException as exc:
                for operation in batch:
                    operation.error = exc
            self.batches += 1
            # One wake-up per event loop for the whole batch: each ``call_soon_threadsafe`` writes to the loop's
            # wake-up pipe, and the loop runs its callbacks in order, so the batch's callers resume in order.
            by_loop: dict[asyncio.AbstractEventLoop, list[_Operation[Any]]] = {}
            for operation in batch:
                by_loop.setdefault(operation.loop, []).append(operation)
            for loop, operations in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_settle, operations)
                except RuntimeError:
                    logger.warning("a caller's event loop closed before its store operation completed")

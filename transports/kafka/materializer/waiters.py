"""The waits on a materializer's progress: blocking and async waits on log positions, and their wake-ups.

A source waits until the event at a position is applied (or, for a freeze answered ahead of its apply, until
its answer is there). The loop owns what "applied" and "answered" mean; this registry only holds the waits,
ends each one on its own event loop when its position is reached, and ends all of them when the loop fails.

Its one condition guards the waits and the loop's state its predicates read: the loop changes that state and
calls ``applied_moved`` or ``answered`` while holding it, so a wait never misses its wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WaiterRegistry"]


@dataclass(frozen=True)
class _AsyncWaiter:
    """One async wait: the position it waits for, how, and the event loop its future belongs to."""

    partition: int
    offset: int
    command: bool
    ahead: bool
    loop: asyncio.AbstractEventLoop


def _resolve_waiter(future: asyncio.Future[None]) -> None:
    """Runs on the waiter's loop: wake it unless it already gave up."""
    if not future.done():
        future.set_result(None)


class WaiterRegistry:
    """Every wait in progress on one materializer, and the failure that ends them all."""

    def __init__(
        self,
        is_applied: Callable[[int, int, bool], bool],
        is_answered_ahead: Callable[[int, int], bool],
    ) -> None:
        """``is_applied(partition, offset, command)`` says whether the event there is applied and durable (for a
        command: with its own rollout's earlier events only); ``is_answered_ahead(partition, offset)`` whether a
        freeze there was answered ahead of its apply. Both are called with ``condition`` held."""
        self.condition = threading.Condition()
        """Held while the loop changes what the predicates read, and by every check of a wait."""
        self._is_applied = is_applied
        self._is_answered_ahead = is_answered_ahead
        self._failure: BaseException | None = None
        self._async_waiters: dict[asyncio.Future[None], _AsyncWaiter] = {}
        """Every async wait in progress, by its future, in the order they began."""
        self._ahead_waiters: dict[tuple[int, int], list[asyncio.Future[None]]] = {}
        """The waits an answer ahead can end, by position: a burst of answers must not rescan every wait."""

    @property
    def failure(self) -> BaseException | None:
        """What stopped the loop, once it failed."""
        return self._failure

    def waiting(self) -> int:
        """How many async waits are in progress."""
        with self.condition:
            return len(self._async_waiters)

    def _is_answered(self, partition: int, offset: int, command: bool, ahead: bool) -> bool:
        """Applied, or (``ahead``) a freeze answered ahead of its apply; the caller holds the condition."""
        return self._is_applied(partition, offset, command) or (
            ahead and self._is_answered_ahead(partition, offset)
        )

    def wait(self, partition: int, offset: int, timeout_s: float) -> bool:
        """Block until every event up to this offset is applied or the loop failed; ``False`` on timeout."""
        with self.condition:
            return bool(
                self.condition.wait_for(
                    lambda: self._failure is not None or self._is_applied(partition, offset, False), timeout_s
                )
            )

    async def wait_async(
        self, partition: int, offset: int, timeout_s: float, *, command: bool = False, ahead: bool = False
    ) -> bool:
        """Wait, without holding a thread, until this position is answered or the loop failed; ``False`` on timeout.

        ``command`` and ``ahead`` say what answers it (``is_applied``'s command form, an answer ahead). A wait
        that times out is forgotten, so an abandoned wait costs nothing later.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self.condition:
            if self._failure is not None or self._is_answered(partition, offset, command, ahead):
                return True
            self._async_waiters[future] = _AsyncWaiter(partition, offset, command, ahead, loop)
            if ahead:
                self._ahead_waiters.setdefault((partition, offset), []).append(future)
        try:
            # A plain await under a timeout: ``asyncio.wait_for`` would resume this caller one event-loop turn later.
            async with asyncio.timeout(timeout_s):
                await future
        except TimeoutError:
            with self.condition:
                self._forget(future)
            return False
        return True

    def applied_moved(self) -> None:
        """Wake every wait that is now answered; the caller holds the condition and has just changed the state."""
        self.condition.notify_all()
        for future, waiter in list(self._async_waiters.items()):
            if self._failure is not None or self._is_answered(
                waiter.partition, waiter.offset, waiter.command, waiter.ahead
            ):
                self._resolve(future)

    def answered(self, partition: int, offset: int) -> None:
        """Wake the waits the freeze answered ahead at this position ends, and no other; caller holds the condition."""
        self.condition.notify_all()
        for future in list(self._ahead_waiters.get((partition, offset), ())):
            self._resolve(future)

    def fail(self, failure: BaseException) -> None:
        """Record why the loop stopped and wake every wait: none of them can be answered any more."""
        with self.condition:
            self._failure = failure
            self.condition.notify_all()
            for future in list(self._async_waiters):
                self._resolve(future)

    def _resolve(self, future: asyncio.Future[None]) -> None:
        """End one wait on its own event loop; caller holds the condition."""
        waiter = self._forget(future)
        if waiter is not None:
            # A closed event loop raises here: nobody is waiting on it any more.
            with contextlib.suppress(RuntimeError):
                waiter.loop.call_soon_threadsafe(_resolve_waiter, future)

    def _forget(self, future: asyncio.Future[None]) -> _AsyncWaiter | None:
        """Drop a wait from both indexes; caller holds the condition."""
        waiter = self._async_waiters.pop(future, None)
        if waiter is not None and waiter.ahead:
            position = (waiter.partition, waiter.offset)
            waiting = self._ahead_waiters.get(position, [])
            if future in waiting:
                waiting.remove(future)
            if not waiting:
                self._ahead_waiters.pop(position, None)
        return waiter

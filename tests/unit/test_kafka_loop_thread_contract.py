"""A materializer's loop lifecycle (``LoopThread``) states what a subclass must give: its ``_run``."""

from __future__ import annotations

import pytest

from transports.kafka.materializer.loop_thread import LoopThread
from transports.kafka.materializer.waiters import WaiterRegistry


def _waiters() -> WaiterRegistry:
    return WaiterRegistry(lambda partition, offset, command: False, lambda partition, offset: False)


class _WithoutRun(LoopThread):
    pass


class _CountingRun(LoopThread):
    def __init__(self) -> None:
        super().__init__("counting", "topic", _waiters())
        self.runs = 0

    def _run(self) -> None:
        self.runs += 1
        self._ready.set()


def test_a_loop_thread_without_its_run_is_refused_when_made_not_when_started() -> None:
    with pytest.raises(TypeError, match="_run"):
        _WithoutRun("without-run", "topic", _waiters())  # type: ignore[abstract]


def test_a_loop_thread_that_gives_its_run_runs_it_in_the_callers_thread() -> None:
    loop = _CountingRun()
    loop.run_until_stopped()
    assert loop.runs == 1

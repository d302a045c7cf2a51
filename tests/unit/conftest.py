"""Unit tests start no process, mount nothing and reach no broker, so the folder stays fast and safe to run anywhere.

A test that needs a child process, a kill or a mount belongs in ``tests/process/``; one that needs a broker
belongs in ``tests/integration/``. The hooks below make a unit test that tries fail and say so, instead of
letting the folder slowly fill up with them again. They cover the test and every fixture set up or torn down
for it, except the session's own fixtures torn down after the last test (those belong to the other folders).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any, NoReturn

import pytest
from kafka_broker_fixture import BROKER_FIXTURES

from tokcap.files.group_commit import filesystem_sync_for

_BROKER_FIXTURES = BROKER_FIXTURES | {"secure_kafka"}

# Every other way to start a program (os.spawn*, pty.fork, asyncio's subprocesses) goes through one of these.
_OS_PROCESS_STARTS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")

# The store looks up libc's syncfs once per process, and the lookup runs `ldconfig -p`: let it happen here,
# outside any test, as it would once in a real program.
filesystem_sync_for(Path(__file__).parent)


class ProcessStartedInUnitTest(AssertionError):
    """A unit test started (or tried to start) a process: move it to ``tests/process/``."""


def _without_processes(item: pytest.Item) -> Generator[None, object, object]:
    """Run one test phase with every process start refused; fail it even if the code under test caught that."""
    attempts: list[str] = []

    def refuse(what: str) -> NoReturn:
        attempts.append(what)
        raise ProcessStartedInUnitTest(
            f"{item.nodeid} started a process ({what}); unit tests start none, so move the test "
            "(with the helpers it needs) to tests/process/"
        )

    def popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        refuse(f"subprocess.Popen({args!r})")

    def process_start(self: multiprocessing.process.BaseProcess) -> None:
        refuse(f"multiprocessing {type(self).__name__}.start()")

    def os_start(name: str) -> Any:
        return lambda *args, **kwargs: refuse(f"os.{name}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", popen)
        patch.setattr(multiprocessing.process.BaseProcess, "start", process_start)
        for name in _OS_PROCESS_STARTS:
            if hasattr(os, name):
                patch.setattr(os, name, os_start(name))
        result = yield
    if attempts:
        pytest.fail(
            f"{item.nodeid} tried to start a process ({'; '.join(attempts)}); unit tests start none, "
            "so move it to tests/process/",
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    """Refuse a unit test that asks for a broker, then set its fixtures up with no process start allowed."""
    wanted = _BROKER_FIXTURES & set(getattr(item, "fixturenames", ()))
    if wanted or item.get_closest_marker("kafka") is not None:
        pytest.fail(
            f"{item.nodeid} needs a Kafka broker ({', '.join(sorted(wanted)) or 'marked kafka'}); "
            "unit tests reach no broker, so move it to tests/integration/",
            pytrace=False,
        )
    return (yield from _without_processes(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """Run the test itself with no process start allowed."""
    return (yield from _without_processes(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """Tear the test's fixtures down with no process start allowed; after the last test the session's own go too."""
    if nextitem is None:
        return (yield)
    return (yield from _without_processes(item))

"""The test session ends with no child process of its own still running.

A child left running outlives the test that started it: it holds ports, files and CPU the later tests and the
next run need, and Python reports its handle only at exit, after every test has passed
(``ResourceWarning: subprocess N is still running``). The check fails the session's last teardown instead and
names each child by its command line, so the test that started it can be found.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["running_children"]

# Helpers multiprocessing starts for itself and stops when this interpreter exits; no test owns them.
_MULTIPROCESSING_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def running_children(parent: int) -> dict[int, str]:
    """Every process whose parent is ``parent`` and that has not exited, with its command line."""
    children: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and state not in ("Z", "X"):
            children[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return children


@pytest.fixture(scope="session", autouse=True)
def _no_child_left_running() -> Iterator[None]:
    """Set up before, so torn down after, every other session fixture: the brokers they stop are gone by then."""
    yield
    left = {
        pid: command
        for pid, command in running_children(os.getpid()).items()
        if not any(helper in command for helper in _MULTIPROCESSING_HELPERS)
    }
    if left:
        listed = "; ".join(f"pid {pid}: {command[:300]}" for pid, command in sorted(left.items()))
        pytest.fail(
            f"the test session ends with {len(left)} child process(es) of its own still running: {listed}. "
            "A test or fixture that starts a process must stop it and wait for it, or start what must outlive "
            "the session the way scripts/kafka-broker does, in a process that exits",
            pytrace=False,
        )

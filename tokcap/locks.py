"""Per-rollout exclusive locks, shared by threads and processes.

One rollout's writers are serialized; different rollouts proceed concurrently.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tokcap.durable_io import open_no_follow

__all__ = ["RolloutLocks"]


@dataclass
class _HeldLock:
    """One rollout's lock inside this process: who waits for it, and the locked file while held."""

    thread_lock: threading.RLock
    users: int = 0
    depth: int = 0
    fd: int = -1


class RolloutLocks:
    """Per-rollout exclusive locks: a thread lock within the process, ``flock`` on the lock file across processes.

    It is the same ``flock`` on the same ``.tokens.lock`` file that the ``filelock`` package takes, so processes
    using either interoperate; it costs a few microseconds where ``filelock`` 4 costs over 100.
    A waiting process blocks in ``flock`` and wakes as soon as the holder releases, instead of polling.
    Re-entry by the thread that holds the lock is allowed, as with ``filelock``.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: dict[str, _HeldLock] = {}

    @contextmanager
    def hold(self, path: Path) -> Iterator[None]:
        """Hold the lock of ``path`` for the duration of the block."""
        key = str(path)
        with self._guard:
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = _HeldLock(threading.RLock())
            held.users += 1
        try:
            with held.thread_lock:
                if held.depth == 0:
                    held.fd = self._lock_file(key)
                held.depth += 1
                try:
                    yield
                finally:
                    held.depth -= 1
                    if held.depth == 0:
                        fd, held.fd = held.fd, -1
                        os.close(fd)
        finally:
            with self._guard:
                held.users -= 1
                if held.users == 0:
                    del self._held[key]

    @staticmethod
    def _lock_file(path: str) -> int:
        """Open the lock file (never removed, so every locker shares one inode) and wait for its ``flock``."""
        fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return fd

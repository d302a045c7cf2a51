"""Per-rollout exclusive locks, shared by threads and processes.

One rollout's writers are serialized; different rollouts proceed concurrently.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections import OrderedDict
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


_KEPT_OPEN = 128
"""How many idle lock files a store keeps open; reopening one costs an ``open`` and a ``close`` per operation."""


class RolloutLocks:
    """Per-rollout exclusive locks: a thread lock within the process, ``flock`` on the lock file across processes.

    It is the same ``flock`` on the same ``.tokens.lock`` file that the ``filelock`` package takes, so processes
    using either interoperate; it costs a few microseconds where ``filelock`` 4 costs over 100.
    A waiting process blocks in ``flock`` and wakes as soon as the holder releases, instead of polling.
    Re-entry by the thread that holds the lock is allowed, as with ``filelock``.

    Idle lock files stay open (a bounded number, least recently used closed first), so a lock costs two
    ``flock`` calls and two ``stat`` calls instead of an ``open`` and a ``close``. A kept descriptor is used only
    while the path still names its file (Gym's ``sweep_retired`` removes lock files), and never in a forked
    child, which would share the parent's open file and so its lock.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: dict[str, _HeldLock] = {}
        self._idle: OrderedDict[str, int] = OrderedDict()
        self._pid = os.getpid()

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
                        self._release(key, fd)
        finally:
            with self._guard:
                held.users -= 1
                if held.users == 0:
                    del self._held[key]

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle lock file; held locks are closed by their holders as usual."""
        with self._guard:
            idle, self._idle = list(self._idle.values()), OrderedDict()
        for fd in idle:
            os.close(fd)

    def _kept_fd(self, path: str) -> int:
        """An idle descriptor of ``path`` kept from an earlier hold, or -1."""
        with self._guard:
            if self._pid != os.getpid():
                # A forked child: its copies share the parent's open files, and so their locks. Closing a copy
                # leaves the parent's descriptor (and any lock on it) as it was.
                inherited, self._idle, self._pid = list(self._idle.values()), OrderedDict(), os.getpid()
            else:
                return self._idle.pop(path, -1)
        for fd in inherited:
            os.close(fd)
        return -1

    def _release(self, path: str, fd: int) -> None:
        """Unlock, and keep the descriptor for the next hold (closing the least recently used beyond the bound)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        evicted = -1
        with self._guard:
            if self._pid == os.getpid():
                self._idle[path] = fd
                if len(self._idle) > _KEPT_OPEN:
                    evicted = self._idle.popitem(last=False)[1]
            else:
                evicted = fd
        if evicted >= 0:
            os.close(evicted)

    def _lock_file(self, path: str) -> int:
        """Lock the lock file (never removed by tokcap, so every locker shares one inode) and return its descriptor.

        A kept descriptor is locked if the path still names its file; after a removal (Gym's sweep) or when none
        is kept, the path is opened, waited on with ``flock``, and checked again, so the lock held is always the
        one every other locker of the path takes.
        """
        fd = self._kept_fd(path)
        while True:
            if fd < 0:
                fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if _same_file(fd, path):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            fd = -1


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (it was not removed or replaced meanwhile)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (found.st_ino, found.st_dev) == (opened.st_ino, opened.st_dev)

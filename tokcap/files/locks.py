"""Exclusive file locks, shared by threads and processes: per rollout, and held-or-refused ones.

One rollout's writers are serialized; different rollouts proceed concurrently. ``ExclusiveFile`` is the same
``flock`` taken without waiting, for a lock only one process may hold at all (a partition's owner).
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from tokcap.files.durable_io import open_no_follow

__all__ = ["ExclusiveFile", "RolloutHold", "RolloutLocks"]


class _RolloutLock:
    """One rollout's lock inside this process.

    ``users`` counts the threads holding or waiting for it; ``fd`` is the open lock file, locked while
    ``depth`` > 0.
    """

    __slots__ = ("depth", "fd", "thread_lock", "users")

    def __init__(self) -> None:
        self.thread_lock = threading.RLock()
        self.users = 0
        self.depth = 0
        self.fd = -1


class RolloutLocks:
    """Per-rollout exclusive locks: a thread lock within the process, ``flock`` on the lock file across processes.

    It is the same ``flock`` on the same ``.tokens.lock`` file that the ``filelock`` package takes, so processes
    using either interoperate; it costs a few microseconds where ``filelock`` 4 costs over 100.
    A waiting process blocks in ``flock`` and wakes as soon as the holder releases, instead of polling.
    Re-entry by the thread that holds the lock is allowed, as with ``filelock``.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, _RolloutLock] = {}

    def hold(self, path: Path) -> RolloutHold:
        """Hold the lock of ``path`` for the duration of a ``with`` block.

        A small class rather than a generator context manager: every event of the apply step takes one,
        and a generator's enter and exit cost several times the ``flock`` itself.
        """
        return RolloutHold(self, str(path))

    def _acquire(self, key: str) -> _RolloutLock:
        with self._guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = _RolloutLock()
            lock.users += 1
        try:
            lock.thread_lock.acquire()
            try:
                if lock.depth == 0:
                    lock.fd = _lock_file(key)
                lock.depth += 1
            except BaseException:
                lock.fd = -1  # closed by the helper that failed
                lock.thread_lock.release()
                raise
        except BaseException:
            self._done(key, lock)
            raise
        return lock

    def _release(self, key: str, lock: _RolloutLock) -> None:
        try:
            lock.depth -= 1
            if lock.depth == 0:
                try:
                    fd, lock.fd = lock.fd, -1
                    os.close(fd)
                finally:
                    lock.thread_lock.release()
            else:
                lock.thread_lock.release()
        finally:
            self._done(key, lock)

    def _done(self, key: str, lock: _RolloutLock) -> None:
        """One user less; a lock nobody uses is forgotten."""
        with self._guard:
            lock.users -= 1
            if not lock.users:
                del self._locks[key]


class RolloutHold:
    """One ``with`` block holding a rollout's lock."""

    __slots__ = ("_key", "_lock", "_locks")

    def __init__(self, locks: RolloutLocks, key: str) -> None:
        self._locks = locks
        self._key = key
        self._lock: _RolloutLock | None = None

    def __enter__(self) -> None:
        self._lock = self._locks._acquire(self._key)

    def __exit__(self, *exc_info: object) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            self._locks._release(self._key, lock)


def _lock_file(path: str) -> int:
    """Open the lock file (never removed by tokcap, so every locker shares one inode) and wait for its ``flock``.

    The file is closed if the wait fails.
    """
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ExclusiveFile:
    """A lock file's ``flock`` taken without waiting, held until ``release`` (or the end of a ``with`` block).

    Another process (or another holder in this one) holding it makes ``acquire`` return ``False`` at once.
    """

    def __init__(self, path: Path) -> None:
        self._path = str(path)
        self._fd = -1

    @property
    def path(self) -> str:
        """The lock file."""
        return self._path

    def acquire(self) -> bool:
        """Take the lock now; ``False`` when someone else holds it."""
        if self._fd >= 0:
            return True
        fd = open_no_follow(self._path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        """Let the lock go; idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> ExclusiveFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

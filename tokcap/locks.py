"""Per-rollout exclusive locks, shared by threads and processes.

One rollout's writers are serialized; different rollouts proceed concurrently.
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tokcap.durable_io import open_no_follow

__all__ = ["KEPT_LOCK_FILES", "RolloutLocks"]

KEPT_LOCK_FILES = 128
"""Unlocked lock files kept open at most while a deferred block runs."""


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
        self._keeping = 0
        self._kept: dict[str, int] = {}

    def keep_files_open(self) -> None:
        """Keep released lock files open (unlocked) for the next hold, until ``stop_keeping_files_open``.

        A deferred block takes each rollout's lock once per event; reopening the lock file by name is the
        dearest part of that. A kept descriptor is only right while the lock file is not removed and
        recreated, which a deferred block already requires of the rollouts it touches (its states live
        in memory until it ends). Calls nest; at most ``KEPT_LOCK_FILES`` are kept, the oldest closed first.
        """
        with self._guard:
            self._keeping += 1

    def stop_keeping_files_open(self) -> None:
        """End one ``keep_files_open``; the last one closes every kept lock file."""
        with self._guard:
            self._keeping -= 1
            if self._keeping:
                return
            kept, self._kept = self._kept, {}
        for fd in kept.values():
            os.close(fd)

    def hold(self, path: Path) -> _Hold:
        """Hold the lock of ``path`` for the duration of a ``with`` block.

        A small class rather than a generator context manager: every event of the apply step takes one,
        and a generator's enter and exit cost several times the ``flock`` itself.
        """
        return _Hold(self, str(path))

    def _acquire(self, key: str) -> _HeldLock:
        with self._guard:
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = _HeldLock(threading.RLock())
            held.users += 1
        try:
            held.thread_lock.acquire()
            try:
                if held.depth == 0:
                    held.fd = self._lock_kept_file(key)
                held.depth += 1
            except BaseException:
                held.thread_lock.release()
                raise
        except BaseException:
            self._forget(key, held)
            raise
        return held

    def _release(self, key: str, held: _HeldLock) -> None:
        try:
            held.depth -= 1
            if held.depth == 0:
                fd, held.fd = held.fd, -1
                try:
                    self._unlock_file(key, fd)
                finally:
                    held.thread_lock.release()
            else:
                held.thread_lock.release()
        finally:
            self._forget(key, held)

    def _lock_kept_file(self, key: str) -> int:
        """Lock the kept descriptor of ``key`` if there is one, else open the lock file and lock it."""
        with self._guard:
            fd = self._kept.pop(key, -1)
        if fd < 0:
            return _lock_file(key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _unlock_file(self, key: str, fd: int) -> None:
        """Unlock and keep the descriptor while files are kept open, else close it (which unlocks)."""
        with self._guard:
            keep = self._keeping > 0
        if not keep:
            os.close(fd)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        evicted = -1
        with self._guard:
            if self._keeping <= 0:
                evicted = fd
            else:
                if len(self._kept) >= KEPT_LOCK_FILES:
                    evicted = self._kept.pop(next(iter(self._kept)))
                self._kept[key] = fd
        if evicted >= 0:
            os.close(evicted)

    def _forget(self, key: str, held: _HeldLock) -> None:
        with self._guard:
            held.users -= 1
            if held.users == 0:
                del self._held[key]


class _Hold:
    """One ``with`` block holding a rollout's lock."""

    __slots__ = ("_held", "_key", "_locks")

    def __init__(self, locks: RolloutLocks, key: str) -> None:
        self._locks = locks
        self._key = key
        self._held: _HeldLock | None = None

    def __enter__(self) -> None:
        self._held = self._locks._acquire(self._key)

    def __exit__(self, *exc_info: object) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._locks._release(self._key, held)


def _lock_file(path: str) -> int:
    """Open the lock file (never removed, so every locker shares one inode) and wait for its ``flock``."""
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd

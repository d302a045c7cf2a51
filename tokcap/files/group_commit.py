"""Group commit: many writers share one filesystem sync, and each still returns only once durable.

A writer notes its write, then waits.
The first waiter syncs the store's filesystem (``syncfs``) on behalf of everyone who wrote before the sync began;
writers that arrive during a sync wait for the next one.
One sync makes file contents, new names, renames and removals durable, so a put with an intent and a state
update costs a share of one sync instead of three fsyncs.
Where ``syncfs`` is missing, ``os.sync`` gives the same guarantee for the whole machine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["GroupCommitter", "filesystem_sync_for"]


@functools.cache
def _syncfs() -> Any:
    """libc's ``syncfs``, or ``None`` where it is missing; looked up once, since the lookup runs ``ldconfig``."""
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name, use_errno=True) if libc_name else None
    return getattr(libc, "syncfs", None) if libc is not None else None


def filesystem_sync_for(directory: Path) -> Callable[[], None]:
    """Return a function that makes every write on ``directory``'s filesystem durable."""
    syncfs = _syncfs()
    if syncfs is None:
        return os.sync

    def sync_filesystem() -> None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if syncfs(fd) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"syncfs({directory}) failed: {os.strerror(errno)}")
        finally:
            os.close(fd)

    return sync_filesystem


class GroupCommitter:
    """Counts writes and makes them durable in shared batches."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self._condition = threading.Condition()
        self._written = 0
        self._durable = 0
        self._syncing = False
        self._failure: tuple[int, OSError] | None = None
        self.syncs = 0

    def note_write(self) -> None:
        """Record that a write happened that must be durable before its caller returns."""
        with self._condition:
            self._written += 1

    def wait_durable(self) -> None:
        """Return once every write noted so far, by any thread, is durable.

        A failed sync raises in every waiter whose writes it covered: none of them may report success.
        """
        with self._condition:
            target = self._written
            while self._durable < target:
                if self._failure is not None and self._failure[0] >= target:
                    raise OSError(self._failure[1].errno, f"group commit failed: {self._failure[1]}")
                if self._syncing:
                    self._condition.wait()
                    continue
                self._syncing = True
                batch = self._written
                self._condition.release()
                error: OSError | None = None
                try:
                    self._sync()
                except OSError as exc:
                    error = exc
                finally:
                    self._condition.acquire()
                    self._syncing = False
                    self.syncs += 1
                    if error is None:
                        self._durable = max(self._durable, batch)
                    else:
                        self._failure = (batch, error)
                    self._condition.notify_all()
                if error is not None:
                    raise error

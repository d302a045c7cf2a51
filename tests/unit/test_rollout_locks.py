"""The per-rollout lock keeps idle lock files open; a kept descriptor must never weaken the lock."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from tokcap.locks import RolloutLocks


def _held_by_someone_else(path: Path) -> bool:
    """Whether a fresh open of ``path`` cannot take its ``flock`` right now."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_lock_file_removed_while_idle_is_locked_at_its_new_file_not_the_kept_one(tmp_path: Path) -> None:
    path = tmp_path / "r.tokens.lock"
    locks = RolloutLocks()
    with locks.hold(path):
        pass
    path.unlink()  # Gym's sweep_retired removes lock files; the next locker creates a new one
    with locks.hold(path):
        assert _held_by_someone_else(path)
    locks.close()


def test_a_forked_child_takes_its_own_lock_and_never_the_parents_kept_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "r.tokens.lock"
    locks = RolloutLocks()
    with locks.hold(path):
        pass
    kept = locks._idle[str(path)]
    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            with locks.hold(path):
                os.write(ready_write, b"x")
                os.read(done_read, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_read, 1) == b"x"
        # Had the child locked the inherited descriptor, this flock on the same open file would succeed.
        with pytest.raises(BlockingIOError):
            fcntl.flock(kept, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.write(done_write, b"x")
        os.waitpid(child, 0)
        for fd in (ready_read, ready_write, done_read, done_write):
            os.close(fd)
    locks.close()


def test_closing_the_locks_closes_every_kept_lock_file(tmp_path: Path) -> None:
    locks = RolloutLocks()
    for index in range(3):
        with locks.hold(tmp_path / f"r{index}.tokens.lock"):
            pass
    kept = list(locks._idle.values())
    locks.close()
    for fd in kept:
        with pytest.raises(OSError):
            os.fstat(fd)

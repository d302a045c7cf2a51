"""Per-rollout locks: what other lockers see, and what a projection holds between events."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from tokcap.files.locks import RolloutLocks
from tokcap.files.log_projection import Projection
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import IntentEvent, LogPosition


def _try_lock(path: Path) -> bool:
    """Whether another open file description can take the lock now (flock locks belong to descriptions)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _lock_files_open(directory: Path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)) and target.endswith(".tokens.lock"):
            count += 1
    return count


def test_a_held_rollout_lock_excludes_other_lockers_and_is_free_once_released(tmp_path: Path) -> None:
    locks = RolloutLocks()
    path = tmp_path / "r.tokens.lock"
    with locks.hold(path):
        assert not _try_lock(path)
        with locks.hold(path):  # the holding thread may enter again
            assert not _try_lock(path)
        assert not _try_lock(path)
    assert _try_lock(path)
    assert _lock_files_open(tmp_path) == 0


def test_a_projection_holds_no_rollout_lock_or_lock_file_between_events(tmp_path: Path) -> None:
    """Readers take a rollout's lock between two events of a block; the block must not hold it for them."""
    store = TokenCaptureStore(tmp_path)
    projection = Projection(store)
    projection.apply(IntentEvent(rollout_id="r", model_call_id="c1"), LogPosition("run", 0, 0))
    projection.write_queued("r")
    assert _lock_files_open(tmp_path) == 0
    assert _try_lock(store.lock_path_for("r"))
    projection.apply(IntentEvent(rollout_id="r", model_call_id="c2"), LogPosition("run", 0, 1))
    projection.write_queued("r")
    assert _try_lock(store.lock_path_for("r"))
    projection.flush()
    assert _lock_files_open(tmp_path) == 0
    assert store.intents_path_for("r").read_bytes() == b"c1\nc2\n"


def test_threads_sharing_rollout_locks_exclude_each_other_and_leave_no_file_open(tmp_path: Path) -> None:
    """Many threads take a few rollouts' locks, re-entering some.

    A rollout's lock is held by one thread at a time, another description of its lock file can never take
    the ``flock`` meanwhile, and once everyone is done no lock file is open and no lock is remembered.
    """
    import random
    import threading

    locks = RolloutLocks()
    paths = [tmp_path / f"r{index}.tokens.lock" for index in range(5)]
    inside: dict[Path, int] = dict.fromkeys(paths, 0)
    guard = threading.Lock()
    failures: list[str] = []

    def worker(seed: int) -> None:
        chooser = random.Random(seed)
        for _ in range(300):
            path = chooser.choice(paths)
            with locks.hold(path):
                with guard:
                    inside[path] += 1
                    if inside[path] != 1:
                        failures.append(f"two holders of {path.name}")
                if chooser.random() < 0.1 and _try_lock(path):
                    failures.append(f"{path.name} was not flocked while held")
                if chooser.random() < 0.2:
                    with locks.hold(path):  # re-entry by the holder keeps it exclusive
                        if _try_lock(path):
                            failures.append(f"{path.name} was not flocked inside a re-entry")
                    if _try_lock(path):
                        failures.append(f"{path.name} was let go by the end of a re-entry")
                with guard:
                    inside[path] -= 1

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert _lock_files_open(tmp_path) == 0
    assert locks._locks == {}
    assert all(_try_lock(path) for path in paths)

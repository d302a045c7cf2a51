"""Group commit: writers share syncs, and nobody returns before a sync that covers their write."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.factories import make_entry
from tokcap.group_commit import GroupCommitter
from tokcap.store import TokenCaptureStore


def test_every_waiter_returns_only_after_a_sync_that_started_after_its_write() -> None:
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    sync_count = 0

    def slow_sync() -> None:
        nonlocal sync_count
        with lock:
            sync_count += 1
            number = sync_count
            events.append(("sync-start", number))
        time.sleep(0.01)
        with lock:
            events.append(("sync-end", number))

    committer = GroupCommitter(slow_sync)

    def writer(worker: int) -> None:
        for _ in range(20):
            with lock:
                events.append(("write", worker))
            committer.note_write()
            committer.wait_durable()
            with lock:
                events.append(("return", worker))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pending: dict[int, int] = {}
    for index, (kind, value) in enumerate(events):
        if kind == "write":
            pending[value] = index
        elif kind == "return":
            write_at = pending.pop(value)
            starts = [i for i, (k, _) in enumerate(events[:index]) if k == "sync-start" and i > write_at]
            ends = [i for i, (k, _) in enumerate(events[:index]) if k == "sync-end" and i > write_at]
            assert starts and ends, "a writer returned without a sync that began after its write"
    assert committer.syncs < 160, "writers did not share syncs"


def test_a_failed_sync_raises_in_every_writer_it_covered() -> None:
    release = threading.Event()

    def failing_sync() -> None:
        release.wait(5)
        raise OSError(5, "disk on fire")

    committer = GroupCommitter(failing_sync)
    errors: list[BaseException] = []

    def writer() -> None:
        committer.note_write()
        try:
            committer.wait_durable()
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    release.set()
    for thread in threads:
        thread.join()
    assert len(errors) == 4


def test_a_store_under_concurrent_puts_runs_fewer_syncs_than_puts(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    barrier = threading.Barrier(8)

    def writer(worker: int) -> None:
        barrier.wait()
        for n in range(25):
            store.append(make_entry(f"r{worker}", f"c{n}"))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(len(store.read_entries(f"r{w}")) for w in range(8)) == 200
    assert 0 < store.commit_stats["syncs"] <= 200


def test_a_failed_sync_fails_the_put_that_depended_on_it(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)

    def broken_sync() -> None:
        raise OSError(28, "no space left")

    store._commit = GroupCommitter(broken_sync)
    with pytest.raises(OSError, match="no space"):
        store.append(make_entry("r", "c1"))

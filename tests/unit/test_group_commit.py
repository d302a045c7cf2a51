"""Group commit: writers share syncs, and nobody returns before a sync that covers their write."""

from __future__ import annotations

import asyncio
import ctypes.util
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import tokcap.files.write_batches
from tests.factories import make_entry
from tokcap.errors import StoreWriteError
from tokcap.files.group_commit import GroupCommitter, filesystem_sync_for
from tokcap.files.store import TokenCaptureStore
from tokcap.files.write_queue import MAX_BATCH


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


def test_writers_that_noted_writes_during_a_sync_share_the_next_one() -> None:
    entered = threading.Event()
    gate = threading.Event()

    def gated_sync() -> None:
        entered.set()
        assert gate.wait(30), "the test never opened the gate"

    committer = GroupCommitter(gated_sync)
    first = threading.Thread(target=lambda: (committer.note_write(), committer.wait_durable()))
    first.start()
    assert entered.wait(30)
    noted = [threading.Event() for _ in range(7)]

    def writer(done: threading.Event) -> None:
        committer.note_write()
        done.set()
        committer.wait_durable()

    others = [threading.Thread(target=writer, args=(done,)) for done in noted]
    for thread in others:
        thread.start()
    for done in noted:
        assert done.wait(30)
    gate.set()
    for thread in [first, *others]:
        thread.join()
    assert committer.syncs == 2, "the seven writes noted during the first sync did not share the second"


def test_a_failed_sync_raises_in_every_writer_it_covered() -> None:
    def failing_sync() -> None:
        raise OSError(5, "disk on fire")

    committer = GroupCommitter(failing_sync)
    errors: list[BaseException] = []
    noted = [threading.Event() for _ in range(4)]
    go = threading.Event()

    def writer(done: threading.Event) -> None:
        committer.note_write()
        done.set()
        assert go.wait(30)
        try:
            committer.wait_durable()
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(done,)) for done in noted]
    for thread in threads:
        thread.start()
    for done in noted:
        assert done.wait(30)
    go.set()
    for thread in threads:
        thread.join()
    assert len(errors) == 4
    assert committer.syncs == 1, "one failed sync covered all four writes"


def _gate_syncs(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Stores opened after this hold every sync until the gate opens; ``entered`` is set when one waits."""
    entered = threading.Event()
    gate = threading.Event()

    def gated_sync_for(directory: Path) -> Callable[[], None]:
        real_sync = filesystem_sync_for(directory)

        def gated_sync() -> None:
            entered.set()
            assert gate.wait(30), "the test never opened the gate"
            real_sync()

        return gated_sync

    monkeypatch.setattr(tokcap.files.write_batches, "filesystem_sync_for", gated_sync_for)
    return entered, gate


def test_a_store_under_concurrent_puts_syncs_once_per_batch_not_once_per_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first put's sync is held until all 200 puts are queued, so the rest run in full batches."""
    entered, gate = _gate_syncs(monkeypatch)
    store = TokenCaptureStore(tmp_path)

    async def main() -> None:
        first = asyncio.ensure_future(store.put(make_entry("r0", "c0")))
        assert await asyncio.to_thread(entered.wait, 30)
        rest = [asyncio.ensure_future(store.put(make_entry(f"r{n % 8}", f"c{n}"))) for n in range(1, 200)]
        await asyncio.sleep(0)  # one pass of the loop: every put above has queued its operation
        gate.set()
        await asyncio.gather(first, *rest)
        await store.close()

    asyncio.run(main())
    assert sum(len(store.read_entries(f"r{w}")) for w in range(8)) == 200
    assert store.commit_stats["syncs"] == 1 + math.ceil(199 / MAX_BATCH)


def test_a_failed_sync_fails_the_put_that_depended_on_it(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)

    def broken_sync() -> None:
        raise OSError(28, "no space left")

    store.files._commit = GroupCommitter(broken_sync)
    with pytest.raises(OSError, match="no space"):
        store.append(make_entry("r", "c1"))


def test_a_store_freezing_a_batch_of_rollouts_at_once_syncs_per_batch_not_per_freeze(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first freeze's sync is held until the other 99 are queued; they then share their batch's syncs."""
    store = TokenCaptureStore(tmp_path)
    for n in range(100):
        store.append(make_entry(f"r{n}", "c0"))
    entered, gate = _gate_syncs(monkeypatch)
    store = TokenCaptureStore(tmp_path)

    async def main() -> list[int]:
        first = asyncio.ensure_future(store.freeze("r0"))
        assert await asyncio.to_thread(entered.wait, 30)
        rest = [asyncio.ensure_future(store.freeze(f"r{n}")) for n in range(1, 100)]
        await asyncio.sleep(0)  # one pass of the loop: every freeze above has queued its operation
        gate.set()
        snapshots = await asyncio.gather(first, *rest)
        await store.close()
        return [len(snapshot.entries) for snapshot in snapshots]

    assert asyncio.run(main()) == [1] * 100
    # Two per batch: one before the batch's state files are renamed (they and what they cover), one after.
    assert store.commit_stats["syncs"] == 2 * (1 + math.ceil(99 / MAX_BATCH))


def test_libc_is_looked_up_once_per_process_not_once_per_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    filesystem_sync_for(tmp_path)
    lookups: list[str] = []
    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: (lookups.append(name), real(name))[1])
    for _ in range(3):
        filesystem_sync_for(tmp_path)()
    assert lookups == []


def test_a_batch_retiring_more_rollouts_than_the_open_file_limit_holds_no_descriptor_per_rollout(
    tmp_path: Path,
) -> None:
    """A batch keeps each unrenamed state's lock until its rename, but only so many: a retire of many rollouts
    renames its fences in groups instead of running out of descriptors."""
    import os
    import resource

    store = TokenCaptureStore(tmp_path)
    rollouts = [f"r{index}" for index in range(200)]
    for rollout_id in rollouts:
        store.append(make_entry(rollout_id, "c0"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    async def main() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 100, hard))
        try:
            await store.retire(rollouts)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await store.close()

    asyncio.run(main())
    assert all(store.read_state(rollout_id).retired for rollout_id in rollouts)
    assert all(store.read_entries(rollout_id) == [] for rollout_id in rollouts)


def _state_files(directory: Path) -> dict[str, bytes]:
    """Every state file and temporary file of a store directory, by name."""
    return {path.name: path.read_bytes() for path in directory.iterdir() if ".state.json" in path.name}


def test_a_failed_sync_before_a_freeze_renames_its_state_leaves_the_old_state_and_no_temporary_file(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    before = _state_files(tmp_path)

    def broken_sync() -> None:
        raise OSError(28, "no space left")

    store.files._commit = GroupCommitter(broken_sync)
    with pytest.raises(StoreWriteError, match="no space"):
        store.freeze_now("r")
    assert _state_files(tmp_path) == before


def test_a_failed_sync_before_a_batchs_renames_fails_every_operation_of_the_batch_and_renames_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's freezes share the sync before their renames: none of them may be answered, none renamed."""
    store = TokenCaptureStore(tmp_path)
    for n in range(4):
        store.append(make_entry(f"r{n}", "c1"))
    before = _state_files(tmp_path)
    entered, gate = _gate_syncs(monkeypatch)
    store = TokenCaptureStore(tmp_path)
    broken = [False]
    sync = store.files._commit._sync

    def breakable_sync() -> None:
        if broken[0]:
            raise OSError(28, "no space left")
        sync()

    store.files._commit = GroupCommitter(breakable_sync)

    async def main() -> list[BaseException | object]:
        held = asyncio.ensure_future(store.put(make_entry("r0", "c2")))
        assert await asyncio.to_thread(entered.wait, 30)
        freezes = [asyncio.ensure_future(store.freeze(f"r{n}")) for n in range(1, 4)]
        await asyncio.sleep(0)  # every freeze above has queued its operation behind the held put
        broken[0] = True
        gate.set()
        results = await asyncio.gather(held, *freezes, return_exceptions=True)
        await store.close()
        return results

    results = asyncio.run(main())
    assert all(isinstance(result, OSError) for result in results[1:]), results
    after = _state_files(tmp_path)
    assert {name: after[name] for name in before if name != "r0.tokens.state.json"} == {
        name: data for name, data in before.items() if name != "r0.tokens.state.json"
    }
    assert not [name for name in after if ".tmp-" in name]

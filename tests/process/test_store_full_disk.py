"""A full disk: every failed write is a clear tokcap error, every file stays readable, nothing acknowledged is lost.

The disk is a real tmpfs of a few pages, mounted by the test (it needs root, as CI runs it). A write that
meets the end of the space is cut short by the kernel, so torn lines really happen.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import make_entry
from tmpfs import fill, mounted_tmpfs

from tokcap.errors import StoreWriteError
from tokcap.files.store import TokenCaptureStore

ROLLOUTS = [f"r{n}" for n in range(6)]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "disk", "96k") as mount_point:
        yield mount_point


def test_a_full_disk_fails_writes_clearly_and_every_rollout_works_once_space_returns(
    small_disk: Path,
) -> None:
    root = small_disk / "store"
    store = TokenCaptureStore(root)
    for rollout_id in ROLLOUTS:
        store.begin_call_now(rollout_id, "c0")
        store.append(make_entry(rollout_id, "c0", prompt=range(40)))
    acknowledged = {rollout_id: ["c0"] for rollout_id in ROLLOUTS}
    filler = small_disk / "filler"
    fill(filler)
    os.truncate(filler, filler.stat().st_size - 6000)
    failures: list[StoreWriteError] = []
    for n in range(1, 80):
        rollout_id = ROLLOUTS[n % len(ROLLOUTS)]
        call_id = f"c{n}-" + "x" * 900  # long lines, so appends cross page boundaries and are torn
        try:
            store.begin_call_now(rollout_id, call_id)
            store.append(make_entry(rollout_id, call_id, prompt=range(300)))
        except StoreWriteError as exc:
            failures.append(exc)
            continue
        acknowledged[rollout_id].append(call_id)
    assert failures, "the disk never filled up"
    for failure in failures:
        message = str(failure)
        assert failure.rollout_id in message and "failed writing" in message and str(root) in message
        assert failure.errno == errno.ENOSPC

    filler.unlink()
    reopened = TokenCaptureStore(root)
    assert not [path.name for path in root.iterdir() if ".tmp-" in path.name]
    for rollout_id in ROLLOUTS:
        reopened.begin_call_now(rollout_id, "after")
        reopened.append(make_entry(rollout_id, "after"))
        snapshot = reopened.freeze_now(rollout_id)
        stored = {entry.model_call_id for entry in snapshot.entries}
        assert set(acknowledged[rollout_id]) | {"after"} <= stored
        assert reopened.drop_now(rollout_id, snapshot.snapshot_id, snapshot.version)

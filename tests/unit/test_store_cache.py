"""A rollout whose files only this store changed is not parsed again: the cached state is reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import make_entry
from tokcap.files import recovery
from tokcap.files.store import TokenCaptureStore


def test_writes_to_a_rollout_no_one_else_touched_never_parse_its_state_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.begin_call_now("r", "c0")
    store.append(make_entry("r", "c0"))
    recoveries: list[str] = []
    original = recovery.recover

    def counted(paths, **kwargs):  # type: ignore[no-untyped-def]
        recoveries.append(paths.rollout_id)
        return original(paths, **kwargs)

    monkeypatch.setattr("tokcap.files.rollout_files.recover", counted)
    for index in range(1, 20):
        store.begin_call_now("r", f"c{index}")
        store.append(make_entry("r", f"c{index}"))
    assert store.freeze_now("r").version == 21
    assert recoveries == []


def test_freezes_run_in_one_writer_batch_share_the_batch_barrier_instead_of_syncing_each(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    for index in range(4):
        store.append(make_entry(f"r{index}", "c0"))
    syncs = store.commit_stats["syncs"]
    for index in range(4):
        snapshot = store._run_without_own_barrier(store.freeze_now, (f"r{index}",))
        assert len(snapshot.entries) == 1
    assert store.commit_stats["syncs"] == syncs
    store._barrier()
    # One sync before the batch's state files are renamed (they and what they cover), one after.
    assert store.commit_stats["syncs"] == syncs + 2

"""Freeze: the cut that decides what a snapshot holds."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.factories import make_entry
from tokcap.errors import RolloutFrozenError
from tokcap.files.store import TokenCaptureStore


def test_a_write_after_freeze_fails_and_moves_the_version(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    snapshot = store.freeze_now("r")
    with pytest.raises(RolloutFrozenError) as raised:
        store.append(make_entry("r", "c2"))
    assert isinstance(raised.value, RuntimeError)
    with pytest.raises(RolloutFrozenError):
        store.begin_call_now("r", "c3")
    again = store.freeze_now("r")
    assert [e.model_call_id for e in again.entries] == ["c1"]
    assert again.snapshot_id == snapshot.snapshot_id
    assert again.version == snapshot.version + 2
    rejections = store.read_state("r").rejections
    assert [(r.event_type, r.model_call_id) for r in rejections] == [("put", "c2"), ("intent", "c3")]
    assert store.drop_now("r", snapshot.snapshot_id, snapshot.version) is False
    assert store.path_for("r").exists()


def test_an_identical_put_after_freeze_is_a_no_op_not_a_rejection(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    snapshot = store.freeze_now("r")
    store.append(make_entry("r", "c1"))
    assert store.freeze_now("r").version == snapshot.version


def test_a_dangling_intent_masks_the_snapshot(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.begin_call_now("r", "c1")
    store.append(make_entry("r", "c1"))
    store.begin_call_now("r", "c2")
    snapshot = store.freeze_now("r")
    assert snapshot.incomplete
    assert store.read_state("r").dangling_intents == ("c2",)


def test_a_cancelled_intent_does_not_mask_the_snapshot(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.begin_call_now("r", "c1")
    store.append(make_entry("r", "c1"))
    store.begin_call_now("r", "c2")
    store.cancel_call_now("r", "c2")
    snapshot = store.freeze_now("r")
    assert not snapshot.incomplete
    assert [e.model_call_id for e in snapshot.entries] == ["c1"]


def test_a_late_incomplete_marker_is_accepted_and_moves_the_version(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    snapshot = store.freeze_now("r")
    assert not snapshot.incomplete
    store.mark_incomplete_now("r", "c2", "late failure")
    again = store.freeze_now("r")
    assert again.incomplete and again.version == snapshot.version + 1
    assert store.drop_now("r", snapshot.snapshot_id, snapshot.version) is False


def test_freeze_is_idempotent(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    first = store.freeze_now("r")
    second = store.freeze_now("r")
    assert first == second


def test_an_empty_rollout_freezes_to_an_empty_snapshot(tmp_path: Path) -> None:
    snapshot = TokenCaptureStore(tmp_path).freeze_now("never-written")
    assert snapshot.entries == () and not snapshot.incomplete and snapshot.version == 1


def test_freeze_is_atomic_against_concurrent_writers(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    accepted: list[str] = []
    refused: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(5)

    def writer(worker: int) -> None:
        start.wait()
        for n in range(40):
            call_id = f"w{worker}-{n}"
            try:
                store.append(make_entry("r", call_id))
            except RolloutFrozenError:
                with lock:
                    refused.append(call_id)
            else:
                with lock:
                    accepted.append(call_id)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    start.wait()
    snapshot = store.freeze_now("r")
    for thread in threads:
        thread.join()
    snapshot_ids = {e.model_call_id for e in snapshot.entries}
    assert snapshot_ids == set(accepted)
    assert snapshot_ids.isdisjoint(refused)
    assert len(accepted) + len(refused) == 160
    assert {e.model_call_id for e in store.freeze_now("r").entries} == snapshot_ids
    assert store.freeze_now("r").version == 1 + len(refused)

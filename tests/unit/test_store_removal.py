"""Drop, retire and delete: what is removed, what is kept, and who can still write."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.factories import make_entry
from tokcap.errors import InvalidRolloutIdError, RolloutRetiredError
from tokcap.files.store import TokenCaptureStore


def test_drop_of_the_exact_snapshot_removes_payloads_and_keeps_the_retired_state_as_fence(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.begin_call_now("r", "c1")
    store.append(make_entry("r", "c1"))
    snapshot = store.freeze_now("r")
    assert store.drop_now("r", snapshot.snapshot_id, snapshot.version) is True
    assert not store.path_for("r").exists() and not store.intents_path_for("r").exists()
    assert store.read_state("r").retired
    assert store.drop_now("r", snapshot.snapshot_id, snapshot.version) is True
    with pytest.raises(RolloutRetiredError):
        store.append(make_entry("r", "c2"))


def test_drop_of_an_open_or_unknown_snapshot_changes_nothing(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    assert store.drop_now("r", "nope", 1) is False
    snapshot = store.freeze_now("r")
    assert store.drop_now("r", "other-id", snapshot.version) is False
    assert store.drop_now("r", snapshot.snapshot_id, snapshot.version + 1) is False
    assert len(store.read_entries("r")) == 1


def test_racing_drops_of_one_snapshot_retire_it_once_and_both_see_success(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    snapshot = store.freeze_now("r")
    results: list[bool] = []
    barrier = threading.Barrier(4)

    def drop() -> None:
        barrier.wait()
        results.append(store.drop_now("r", snapshot.snapshot_id, snapshot.version))

    threads = [threading.Thread(target=drop) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * 4
    assert store.read_state("r").retired


def test_a_drop_racing_a_late_write_keeps_the_evidence(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    snapshot = store.freeze_now("r")
    with pytest.raises(RuntimeError):
        store.append(make_entry("r", "late"))
    assert store.drop_now("r", snapshot.snapshot_id, snapshot.version) is False
    assert [e.model_call_id for e in store.read_entries("r")] == ["c1"]


def test_retire_keeps_the_fence_so_a_late_write_fails(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    payload = store.retire_now(["r", "never-seen"])
    assert payload.removed == ("r",) and payload.not_found == ("never-seen",)
    for rollout_id in ("r", "never-seen"):
        with pytest.raises(RolloutRetiredError):
            store.append(make_entry(rollout_id, "late"))
        with pytest.raises(RolloutRetiredError):
            store.begin_call_now(rollout_id, "late")
    assert store.retire_now(["r"]).removed == ()
    assert not store.path_for("r").exists()


def test_retire_works_whatever_the_state(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("open", "c1"))
    store.append(make_entry("frozen", "c1"))
    store.freeze_now("frozen")
    store.mark_incomplete_now("masked", "c1")
    payload = store.retire_now(["open", "frozen", "masked"])
    assert payload.removed == ("open", "frozen", "masked")
    assert all(store.read_state(r).retired for r in ("open", "frozen", "masked"))


def test_delete_allows_reuse_with_an_empty_rollout(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    first = store.freeze_now("r")
    store.retire_now(["r"])
    assert store.delete_now(["r"]).removed == ("r",)
    assert store.delete_now(["r"]).not_found == ("r",)
    assert not store.state_path_for("r").exists()
    reused = store.freeze_now("r")
    assert reused.entries == () and reused.snapshot_id != first.snapshot_id
    store.delete_now(["r"])
    store.append(make_entry("r", "c2"))
    assert [e.model_call_id for e in store.read_entries("r")] == ["c2"]


@pytest.mark.parametrize("method", ["retire_now", "delete_now"])
def test_a_batch_with_one_bad_id_changes_nothing(tmp_path: Path, method: str) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("good", "c1"))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(InvalidRolloutIdError):
        getattr(store, method)(["good", "../escape"])
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert len(store.read_entries("good")) == 1


@pytest.mark.parametrize("method", ["retire_now", "delete_now"])
def test_a_bare_string_is_refused_as_a_batch(tmp_path: Path, method: str) -> None:
    with pytest.raises(InvalidRolloutIdError, match="bare string"):
        getattr(TokenCaptureStore(tmp_path), method)("abc")


def test_duplicate_ids_in_a_batch_are_handled_once(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r", "c1"))
    assert store.retire_now(["r", "r"]).removed == ("r",)

"""``tokcap demo`` over the file store: it completes, and its summary is what the store holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_helpers import tokcap

from tokcap.cli.demo import FAULT_FAILED_WRITE, FAULT_LATE_WRITE, FAULT_LOST_CALL, FAULT_RETRY
from tokcap.files.store import TokenCaptureStore


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    store_dir = tmp_path_factory.mktemp("demo") / "store"
    completed = tokcap("demo", "--rollouts", "12", "--turns", "3", "--dir", str(store_dir), "--json")
    assert completed.returncode == 0, completed.stderr
    return store_dir, completed.json()


def test_demo_reports_every_rollout_and_keeps_the_directory_it_was_given(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    store_dir, report = demo_run
    assert report["transport"] == "file"
    assert report["store_dir"] == str(store_dir) and report["store_kept"] is True
    assert [r["rollout_id"] for r in report["rollouts"]] == [f"demo-{i:05d}" for i in range(12)]
    assert TokenCaptureStore(store_dir).rollout_ids() == [r["rollout_id"] for r in report["rollouts"]]


def test_retired_rollouts_in_the_summary_are_fenced_and_empty_in_the_store(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    store_dir, report = demo_run
    store = TokenCaptureStore(store_dir)
    retired = [r for r in report["rollouts"] if r["retired"]]
    assert len(retired) == report["totals"]["retired"] == 12 - 3
    for rollout in retired:
        rid = rollout["rollout_id"]
        assert store.read_state(rid).retired
        assert store.state_path_for(rid).exists()
        assert not store.path_for(rid).exists()


def test_kept_rollouts_hold_exactly_the_captured_calls_and_their_incomplete_marks(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    store_dir, report = demo_run
    store = TokenCaptureStore(store_dir)
    kept = [r for r in report["rollouts"] if not r["retired"]]
    assert {r["fault"] for r in kept} == {FAULT_LOST_CALL, FAULT_FAILED_WRITE, FAULT_LATE_WRITE}
    for rollout in kept:
        rid = rollout["rollout_id"]
        state = store.read_state(rid)
        assert state.lifecycle.value == "frozen"
        assert state.snapshot_id == rollout["snapshot_id"]
        assert len(store.read_entries(rid)) == rollout["calls_captured"]
        assert store.is_incomplete(rid) == ("incomplete" in rollout["mask_reasons"])


def test_each_fault_has_the_effect_the_summary_names(demo_run: tuple[Path, dict[str, Any]]) -> None:
    store_dir, report = demo_run
    store = TokenCaptureStore(store_dir)
    by_fault = {r["fault"]: r for r in report["rollouts"] if r["fault"]}
    assert by_fault[FAULT_LOST_CALL]["mask_reasons"] == ["incomplete"]
    assert store.read_state(by_fault[FAULT_LOST_CALL]["rollout_id"]).dangling_intents == ("turn-1-lost",)
    # The call after the failed write cannot prove its parent, so the scored chain is broken as well.
    assert by_fault[FAULT_FAILED_WRITE]["mask_reasons"] == ["incomplete", "terminal-not-delivered"]
    assert by_fault[FAULT_FAILED_WRITE]["writes_failed"] == 1
    assert by_fault[FAULT_RETRY]["masked"] is False and by_fault[FAULT_RETRY]["retired"] is True
    late = by_fault[FAULT_LATE_WRITE]
    assert late["masked"] is False and late["retired"] is False and late["late_write"]
    late_state = store.read_state(late["rollout_id"])
    assert late_state.version == late["version"] + 1
    assert [rejection.model_call_id for rejection in late_state.rejections] == ["straggler"]


def test_totals_add_up_over_the_rollouts(demo_run: tuple[Path, dict[str, Any]]) -> None:
    _, report = demo_run
    totals, rollouts = report["totals"], report["rollouts"]
    assert totals["trained"] + totals["masked"] == totals["rollouts"] == 12
    assert totals["mask_reasons"] == {"incomplete": 2, "terminal-not-delivered": 1}
    assert totals["calls_captured"] == sum(r["calls_captured"] for r in rollouts) == 12 * 3 + 1 - 1
    assert totals["trained_tokens"] == sum(r["trained_tokens"] for r in rollouts) > 0
    assert all(r["trained_tokens"] == 0 for r in rollouts if r["masked"])


def test_demo_without_a_directory_removes_its_temporary_store_unless_asked_to_keep_it() -> None:
    removed = tokcap("demo", "--rollouts", "2", "--turns", "2", "--json")
    assert removed.returncode == 0, removed.stderr
    assert removed.json()["store_kept"] is False
    assert not Path(removed.json()["store_dir"]).exists()
    kept = tokcap("demo", "--rollouts", "2", "--turns", "2", "--keep-dir", "--json")
    assert kept.returncode == 0, kept.stderr
    assert Path(kept.json()["store_dir"]).is_dir()


def test_the_human_summary_names_the_masks_and_the_store(tmp_path: Path) -> None:
    completed = tokcap("demo", "--rollouts", "6", "--turns", "2", "--dir", str(tmp_path / "s"))
    assert completed.returncode == 0, completed.stderr
    assert "incomplete x2" in completed.stdout
    assert str(tmp_path / "s") in completed.stdout
    assert "lost-call" in completed.stdout and "late-write" in completed.stdout

"""``tokcap demo --engine-side`` and ``tokcap inspect`` of staged calls and ledger rows, on the file store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import tokcap
from staging_calls import commit_for, conversation

from tokcap.cli.demo import FAULT_FAILED_WRITE, FAULT_LATE_WRITE, FAULT_LOST_CALL, FAULT_RETRY
from tokcap.files.store import TokenCaptureStore
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    store_dir = tmp_path_factory.mktemp("demo") / "store"
    completed = tokcap(
        "demo", "--engine-side", "--rollouts", "12", "--turns", "3", "--dir", str(store_dir), "--json"
    )
    assert completed.returncode == 0, completed.stderr
    return store_dir, completed.json()


def test_the_engine_side_demo_trains_every_rollout_but_the_two_whose_capture_failed(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    _, report = demo_run
    assert report["transport"] == "file-staging"
    by_fault = {r["fault"]: r for r in report["rollouts"]}
    assert (
        by_fault[FAULT_LOST_CALL]["masked"] and "worker_died" in by_fault[FAULT_LOST_CALL]["mask_reasons"][0]
    )
    failed = by_fault[FAULT_FAILED_WRITE]
    assert failed["masked"] and failed["writes_failed"] == 1 and "capture_failed" in failed["mask_reasons"][0]
    assert not by_fault[FAULT_RETRY]["masked"]
    assert "fence refused" in by_fault[FAULT_LATE_WRITE]["late_write"]
    totals = report["totals"]
    assert (totals["trained"], totals["masked"], totals["retired"]) == (10, 2, 10)
    for rollout in report["rollouts"]:
        if not rollout["masked"]:
            assert rollout["trained_tokens"] == rollout["prompt_tokens"] + rollout["generated_tokens"] > 0


def test_trained_rollouts_are_retired_and_masked_ones_keep_their_staged_and_ledger_rows(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    store_dir, report = demo_run
    store = TokenCaptureStore(store_dir)
    for rollout in report["rollouts"]:
        state = store.read_state(rollout["rollout_id"])
        assert state.retired == (not rollout["masked"])
        if rollout["masked"]:
            assert len(state.staged) == rollout["calls_captured"]
            assert len(state.ledger) + len(state.ledger_failures) == rollout["calls_attempted"]


def test_inspect_shows_a_masked_rollouts_staged_calls_ledger_rows_and_why_it_is_masked(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    store_dir, report = demo_run
    lost = next(r for r in report["rollouts"] if r["fault"] == FAULT_LOST_CALL)
    detail = tokcap("inspect", str(store_dir), lost["rollout_id"], "--json").json()
    assert [row["staging_key"] for row in detail["staged"]] == [
        f"{lost['rollout_id']}/call-{n}" for n in range(3)
    ]
    assert [row["model_call_id"] for row in detail["ledger"]] == ["call-0", "call-1"]
    assert detail["ledger_failures"] == [
        {"model_call_id": "call-2", "reason": "worker_died", "schema_version": 2}
    ]
    assert detail["staging_verdict"].startswith("masked: worker_died")
    listing = tokcap("inspect", str(store_dir), "--json").json()
    row = next(r for r in listing["rollouts"] if r["rollout_id"] == lost["rollout_id"])
    assert (row["staged"], row["ledger_rows"], row["ledger_failures"]) == (3, 2, 1)
    text = tokcap("inspect", str(store_dir), lost["rollout_id"]).stdout
    assert "staged calls (3)" in text and "ledger failure: call call-2: worker_died" in text


def test_inspect_says_a_complete_staged_rollout_would_train(tmp_path: Path) -> None:
    sink, ledger = FileStagingSink(tmp_path), FileLineageResolver(tmp_path)
    for turn in conversation("r1", 3, extras=True):
        assert sink.stage(turn.call, attachments={"image": b"png"}).ok
        asyncio.run(ledger.record(commit_for(turn)))
    detail = tokcap("inspect", str(tmp_path), "r1", "--json").json()
    assert detail["staging_verdict"] == "trained"
    assert [row["attachments"] for row in detail["staged"]] == [{"image": 3}] * 3
    assert all(row["extras_bytes"] for row in detail["staged"])


def test_engine_side_demo_refuses_a_broker() -> None:
    completed = tokcap("demo", "--engine-side", "--bootstrap", "127.0.0.1:1", "--rollouts", "1")
    assert completed.returncode != 0 and "--engine-side runs on the file store" in completed.stderr

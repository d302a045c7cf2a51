"""``tokcap staging status DIR``: staged calls not retired per rollout, their bytes and age, the calls no ledger row
names, the pending rollouts; every error one line on stderr."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from staging_calls import commit_for, conversation

from tokcap.cli import run
from tokcap.cli.staging_status import describe_staging, render_staging_status
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, JournaledStagingSink
from tokcap.staging.records import StageResult


def _journal(root: Path) -> None:
    """Four rollouts: ``done`` committed whole, ``orphan`` staged with no ledger row for its last call (its
    model server died), ``failed`` with a failure row, and ``old`` retired."""
    sink = FileStagingSink(root)
    ledger = FileLineageResolver(root)

    async def record() -> None:
        for rollout, turns, recorded in (("done", 2, 2), ("orphan", 3, 1), ("failed", 1, 0), ("old", 1, 1)):
            for number, turn in enumerate(conversation(rollout, turns, extras=True)):
                attachments = {"image": b"x" * 1000, "empty": b""} if number == 0 else None
                assert sink.stage(turn.call, attachments=attachments).ok
                if number < recorded:
                    await ledger.record(commit_for(turn))
        await ledger.record_failure("failed", "call-0", "the model server timed out")
        await ledger.retire(["old"])
        await ledger.close()

    asyncio.run(record())


def test_a_staged_call_without_a_ledger_row_shows_with_its_age_and_bytes(tmp_path: Path) -> None:
    _journal(tmp_path)
    staged_file = tmp_path / "orphan.tokens.staged"
    an_hour_ago = time.time() - 3600
    os.utime(staged_file, (an_hour_ago, an_hour_ago))
    status = describe_staging(tmp_path)
    by_id = {rollout["rollout_id"]: rollout for rollout in status["rollouts"]}
    assert sorted(by_id) == ["done", "failed", "orphan"]
    orphan = by_id["orphan"]
    assert (orphan["staged_calls"], orphan["ledger_rows"], orphan["failure_rows"]) == (3, 1, 0)
    assert [call["staging_key"] for call in orphan["unledgered"]] == ["orphan/call-1", "orphan/call-2"]
    assert all(3590 <= call["age_s"] <= 3700 for call in orphan["unledgered"])
    assert 3590 <= orphan["age_s"] <= 3700 and status["age_basis"] == "last-write"
    assert by_id["done"]["unledgered"] == [] and by_id["done"]["age_s"] < 3590
    # The row lines, the extras blobs and the 1,000-byte image: more than the image, less than twice the lines.
    lines = staged_file.read_bytes()
    assert orphan["staged_bytes"] > len(lines) + 1000
    # A failure row records its call too: only the orphan's two calls have no row at all.
    assert status["totals"]["unledgered_calls"] == 2 and by_id["failed"]["unledgered"] == []


def test_pending_rollouts_are_the_committed_ones_not_retired_with_their_failure_rows(tmp_path: Path) -> None:
    _journal(tmp_path)
    status = describe_staging(tmp_path)
    assert status["pending_rollouts"] == [
        {"rollout_id": "done", "has_failures": False},
        {"rollout_id": "orphan", "has_failures": False},
    ]
    assert status["totals"]["pending_rollouts"] == 2


def test_the_command_prints_the_status_as_json_and_as_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _journal(tmp_path)
    assert run(["staging", "status", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["rollouts"] == 3
    assert run(["staging", "status", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "no ledger row: orphan/call-2" in shown
    assert "pending rollouts (committed, not retired): 2" in shown


def test_the_table_names_every_call_without_a_ledger_row(tmp_path: Path) -> None:
    _journal(tmp_path)
    console = Console(record=True, width=200)
    render_staging_status(describe_staging(tmp_path), console)
    text = console.export_text()
    assert "orphan/call-1" in text and "orphan/call-2" in text and "failed/call-0" not in text


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["absent"], "does not exist"),
        ([".", "--bootstrap", "127.0.0.1:1"], "not both"),
        ([], "give a store directory"),
        ([".", "--run", "r1"], "--bootstrap"),
    ],
)
def test_a_wrong_command_line_fails_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], said: str
) -> None:
    where = [
        str(tmp_path / argument) if not argument.startswith("-") and index == 0 else argument
        for index, argument in enumerate(arguments)
    ]
    assert run(["staging", "status", *where]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tokcap: error:") and said in err


class _Store:
    """A trainer's in-memory store: accepts every call."""

    def stage(self, record: Any, *, attachments: Any = None) -> Any:
        return StageResult(ok=True, staging_key=f"{record.rollout_id}/{record.model_call_id}")


def test_every_cursor_a_trainer_took_is_listed_oldest_first(tmp_path: Path) -> None:
    sink = JournaledStagingSink(_Store(), FileStagingSink(tmp_path))

    for number, turn in enumerate(conversation("c", 2)):
        assert sink.stage(turn.call).ok
        sink.cursor(f"step-{number}")
    status = describe_staging(tmp_path)
    assert [cursor["label"] for cursor in status["cursors"]] == ["step-0", "step-1"]
    assert status["cursors"][1]["rollouts"]["c"]["size"] > status["cursors"][0]["rollouts"]["c"]["size"]
    assert status["totals"]["cursors"] == 2


def test_cursors_recorded_elsewhere_are_read_from_the_cursor_dir_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _journal(tmp_path / "store")
    sink = JournaledStagingSink(_Store(), FileStagingSink(tmp_path / "store"), cursor_dir=tmp_path)

    sink.cursor("before-snapshot-7")
    assert describe_staging(tmp_path / "store")["cursors"] == []
    assert run(["staging", "status", str(tmp_path / "store"), "--cursor-dir", str(tmp_path), "--json"]) == 0
    assert [c["label"] for c in json.loads(capsys.readouterr().out)["cursors"]] == ["before-snapshot-7"]
    assert run(["staging", "status", str(tmp_path / "store"), "--cursor-dir", str(tmp_path / "absent")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cursor directory" in err

"""The journal behind an in-memory staging store, on the file store: stage, cursor, restage, pending rollouts."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from memory_staging_store import AsyncMemoryStagingStore, MemoryStagingStore
from staging_calls import commit_for, conversation, staged_call

import tokcap.files.write_batches
import tokcap.staging.journal
from tokcap.errors import InvalidInputError, StoreCorruptionError
from tokcap.files.store import TokenCaptureStore
from tokcap.ledger import PendingRollout
from tokcap.lineage import FileLineageResolver
from tokcap.log.events import LogPosition
from tokcap.log.state import RolloutState, StagedSlot
from tokcap.staging import (
    FileStagingSink,
    FileStagingSource,
    JournalCursor,
    JournaledStagingSink,
    RestageRefusal,
    cursors_taken,
    restage,
    staged_rollouts,
)
from tokcap.staging.journal import REFUSED_STAGE_REASON, RolloutMark, record_cursor

ATTACHMENTS = {"empty": b"", "image": bytes(range(256)) * 40}


def _journaled(
    root: Path, inner: MemoryStagingStore | None = None
) -> tuple[JournaledStagingSink, MemoryStagingStore]:
    store = inner if inner is not None else MemoryStagingStore()
    return JournaledStagingSink(store, FileStagingSink(root)), store


def test_restage_gives_a_fresh_store_every_call_exactly_as_first_given_extras_and_an_empty_attachment_included(
    tmp_path: Path,
) -> None:
    sink, first = _journaled(tmp_path)
    turns = conversation("r1", 3, extras=True) + conversation("r2", 2)
    for number, turn in enumerate(turns):
        result = sink.stage(turn.call, attachments=ATTACHMENTS if number % 2 else None)
        assert result.ok, result.error
    fresh = MemoryStagingStore()
    report = restage(FileStagingSource(tmp_path), fresh)
    assert (report.restaged, report.retired, report.refused, report.failed) == (5, 0, 0, 0)
    assert fresh.stored == first.stored
    assert fresh.given == [first.stored[f"{t.call.rollout_id}/{t.call.model_call_id}"] for t in turns]
    assert fresh.stored["r1/call-1"].attachments == ATTACHMENTS
    assert orjson.loads(fresh.stored["r1/call-2"].record_json)["extras"] == turns[2].call.extras


def test_a_call_staged_after_the_cursor_comes_back_and_one_before_it_only_without_a_cursor(
    tmp_path: Path,
) -> None:
    sink, _ = _journaled(tmp_path)
    before = conversation("r1", 2) + conversation("r2", 1)
    for turn in before:
        assert sink.stage(turn.call).ok
    cursor = JournalCursor.from_json(sink.cursor("step-10").to_json())
    after = [staged_call("r1", "late", [7], [8]), *(turn.call for turn in conversation("r3", 2))]
    for call in after:
        assert sink.stage(call).ok
    fresh = MemoryStagingStore()
    report = restage(FileStagingSource(tmp_path), fresh, after=cursor)
    assert report.restaged == 3
    assert [orjson.loads(c.record_json)["model_call_id"] for c in fresh.given] == ["late", "call-0", "call-1"]
    everything = MemoryStagingStore()
    assert restage(FileStagingSource(tmp_path), everything).restaged == 6


def test_only_the_given_rollouts_are_restaged_and_an_unknown_one_counts_as_deleted(tmp_path: Path) -> None:
    sink, first = _journaled(tmp_path)
    for turn in conversation("r1", 2) + conversation("r2", 2):
        assert sink.stage(turn.call).ok
    fresh = MemoryStagingStore()
    report = restage(FileStagingSource(tmp_path), fresh, rollout_ids=["r2", "gone"])
    assert report.restaged == 2 and report.retired_rollouts == ("gone",)
    assert fresh.stored == {key: call for key, call in first.stored.items() if key.startswith("r2/")}


def test_restage_skips_retired_and_deleted_rollouts_and_counts_them(tmp_path: Path) -> None:
    sink, _ = _journaled(tmp_path)
    for rollout_id in ("keep", "retired", "deleted"):
        for turn in conversation(rollout_id, 2):
            assert sink.stage(turn.call).ok
    ledger = FileLineageResolver(tmp_path)
    asyncio.run(ledger.retire(["retired"]))
    asyncio.run(ledger.delete(["deleted"]))
    fresh = MemoryStagingStore()
    report = restage(FileStagingSource(tmp_path), fresh)
    assert report.restaged == 2 and report.retired == 1 and report.retired_rollouts == ("retired",)
    assert sorted(fresh.stored) == ["keep/call-0", "keep/call-1"]
    asked = restage(FileStagingSource(tmp_path), MemoryStagingStore(), rollout_ids=["retired", "deleted"])
    assert (asked.restaged, asked.retired) == (0, 2)


def test_restage_reports_each_call_the_inner_store_refuses_or_raises_on_with_its_reason(
    tmp_path: Path,
) -> None:
    sink, _ = _journaled(tmp_path)
    for turn in conversation("r1", 3):
        assert sink.stage(turn.call).ok
    fresh = MemoryStagingStore(refuse=frozenset({"r1/call-0"}), raise_on=frozenset({"r1/call-2"}))
    report = restage(FileStagingSource(tmp_path), fresh)
    assert (report.restaged, report.refused) == (1, 2)
    assert report.refusals == (
        RestageRefusal("r1/call-0", "r1/call-0 refused: the store is full"),
        RestageRefusal(
            "r1/call-2",
            "the inner store raised RuntimeError: store lost its connection while staging r1/call-2",
        ),
    )


def test_two_fresh_stores_restaged_are_equal_and_a_second_restage_gives_identical_repeats_only(
    tmp_path: Path,
) -> None:
    sink, _ = _journaled(tmp_path)
    for number, turn in enumerate(conversation("r1", 3, extras=True) + conversation("r2", 2)):
        assert sink.stage(turn.call, attachments={"n": bytes([number])}).ok
    one, two = MemoryStagingStore(), MemoryStagingStore()
    restage(FileStagingSource(tmp_path), one)
    restage(FileStagingSource(tmp_path), two)
    assert one.given == two.given and one.stored == two.stored
    restage(FileStagingSource(tmp_path), one)
    assert one.given == two.given + two.given and one.stored == two.stored


def test_a_stage_the_inner_store_refused_is_not_ok_and_never_restaged(tmp_path: Path) -> None:
    inner = MemoryStagingStore(refuse=frozenset({"r1/call-1"}), raise_on=frozenset({"r1/call-2"}))
    sink, _ = _journaled(tmp_path, inner)
    results = [sink.stage(turn.call) for turn in conversation("r1", 3)]
    assert [result.ok for result in results] == [True, False, False]
    assert "inner store refused it: r1/call-1 refused: the store is full" in results[1].error
    assert "RuntimeError" in results[2].error and "a restage skips it" in results[2].error
    manifest = asyncio.run(FileLineageResolver(tmp_path).manifest("r1"))
    assert {(f["model_call_id"], f["reason"]) for f in manifest["failures"]} == {
        ("call-1", REFUSED_STAGE_REASON),
        ("call-2", REFUSED_STAGE_REASON),
    }
    fresh = MemoryStagingStore()
    report = restage(FileStagingSource(tmp_path), fresh)
    assert (report.restaged, report.failed) == (1, 2) and list(fresh.stored) == ["r1/call-0"]


def test_the_failure_row_gym_records_for_a_refused_stage_is_an_identical_repeat(tmp_path: Path) -> None:
    sink, _ = _journaled(tmp_path, MemoryStagingStore(refuse=frozenset({"r1/call-0"})))
    [turn] = conversation("r1", 1)
    assert not sink.stage(turn.call).ok
    asyncio.run(FileLineageResolver(tmp_path).record_failure("r1", "call-0", "worker_capture_failed"))


def test_a_stage_the_journal_refused_is_not_ok_and_the_inner_store_is_not_asked(tmp_path: Path) -> None:
    sink, inner = _journaled(tmp_path)
    [turn] = conversation("r1", 1)
    asyncio.run(FileLineageResolver(tmp_path).retire(["r1"]))
    result = sink.stage(turn.call)
    assert not result.ok and "the journal refused the call" in result.error and "retired" in result.error
    assert inner.given == []


def test_a_stage_the_journal_refused_for_another_payload_poisons_the_call_so_neither_payload_is_restaged(
    tmp_path: Path,
) -> None:
    sink, inner = _journaled(tmp_path)
    first = staged_call("r1", "c0", [1, 2], [3])
    other = staged_call("r1", "c0", [1, 2], [4])
    assert sink.stage(first).ok
    result = sink.stage(other)
    assert not result.ok and "already staged with a different payload" in result.error
    assert "the journal recorded the refusal" in result.error and len(inner.given) == 1
    failures = asyncio.run(FileLineageResolver(tmp_path).manifest("r1"))["failures"]
    assert failures == [{"schema_version": 2, "model_call_id": "c0", "reason": REFUSED_STAGE_REASON}]
    report = restage(FileStagingSource(tmp_path), MemoryStagingStore())
    assert (report.restaged, report.failed) == (0, 1)


def test_an_inner_store_without_a_synchronous_stage_is_refused_before_anything_is_staged(
    tmp_path: Path,
) -> None:
    for inner in (AsyncMemoryStagingStore(), object()):
        with pytest.raises(InvalidInputError, match="synchronous stage method"):
            JournaledStagingSink(inner, FileStagingSink(tmp_path))
        with pytest.raises(InvalidInputError, match="synchronous stage method"):
            restage(FileStagingSource(tmp_path), inner)
    assert FileStagingSource(tmp_path).journal_store().rollout_ids() == []


def test_a_cursor_waits_for_a_stage_journaled_before_it_whose_inner_stage_is_still_running(
    tmp_path: Path,
) -> None:
    hold = threading.Event()
    inner = MemoryStagingStore(hold=hold)
    sink, _ = _journaled(tmp_path, inner)
    [turn] = conversation("r1", 1)
    taken: list[JournalCursor] = []

    results: list[Any] = []
    staging = threading.Thread(target=lambda: results.append(sink.stage(turn.call)))
    staging.start()
    assert inner.entered.wait(30)
    cursoring = threading.Thread(target=lambda: taken.append(sink.cursor("snapshot")))
    cursoring.start()
    cursoring.join(0.2)
    assert cursoring.is_alive(), "the cursor returned while a journaled call was not in the inner store"
    hold.set()
    staging.join(30)
    cursoring.join(30)
    assert results[0].ok and len(taken) == 1
    assert "r1/call-0" in inner.stored
    assert taken[0].rollouts["r1"].staged_size > 0


def test_a_rollout_deleted_and_staged_again_after_the_cursor_comes_back_whole(tmp_path: Path) -> None:
    sink, _ = _journaled(tmp_path)
    for turn in conversation("r1", 2):
        assert sink.stage(turn.call).ok
    cursor = sink.cursor("before-reuse")
    asyncio.run(FileLineageResolver(tmp_path).delete(["r1"]))
    again = conversation("r1", 3, base=500)
    for turn in again:
        assert sink.stage(turn.call).ok
    fresh = MemoryStagingStore()
    assert restage(FileStagingSource(tmp_path), fresh, after=cursor).restaged == 3
    assert [orjson.loads(c.record_json)["digest"] for c in fresh.given] == [t.call.digest for t in again]


def test_a_cursor_round_trips_through_json_and_other_text_is_refused_with_the_reason() -> None:
    file_cursor = JournalCursor("step-3", "file", 1.5, rollouts={"r1": RolloutMark(10, "a" * 64)})
    kafka_cursor = JournalCursor("step-4", "kafka", 2.5, topic="tokcap.run", offsets={0: 3, 2: 9})
    for cursor in (file_cursor, kafka_cursor):
        assert JournalCursor.from_json(cursor.to_json()) == cursor
    for text in ("[]", "{}", '{"version": 2}', kafka_cursor.to_json().replace('"0":3', '"x":3'), "not json"):
        with pytest.raises(InvalidInputError, match="not a journal cursor"):
            JournalCursor.from_json(text)


def test_a_cursor_taken_on_another_journal_is_refused_by_restage(tmp_path: Path) -> None:
    kafka_cursor = JournalCursor("step-4", "kafka", 2.5, topic="tokcap.run", offsets={0: 3})
    with pytest.raises(InvalidInputError, match="taken on the kafka journal"):
        restage(FileStagingSource(tmp_path), MemoryStagingStore(), after=kafka_cursor)


def test_cursors_taken_are_recorded_in_the_store_directory_oldest_first(tmp_path: Path) -> None:
    sink, _ = _journaled(tmp_path)
    assert cursors_taken(tmp_path) == []
    [turn] = conversation("r1", 1)
    first = sink.cursor("step-1")
    assert sink.stage(turn.call).ok
    second = sink.cursor("step-2")
    assert cursors_taken(tmp_path) == [first, second]
    assert FileStagingSource(tmp_path).journal_store().rollout_ids() == ["r1"]


def test_a_stage_through_the_journal_syncs_exactly_as_often_as_a_plain_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[str] = []
    real_fsync, real_sync_for = os.fsync, tokcap.files.write_batches.filesystem_sync_for

    def counted_fsync(fd: int) -> None:
        syncs.append("fsync")
        real_fsync(fd)

    def counted_sync_for(directory: Path) -> Callable[[], None]:
        sync = real_sync_for(directory)

        def counted() -> None:
            syncs.append("syncfs")
            sync()

        return counted

    monkeypatch.setattr(os, "fsync", counted_fsync)
    monkeypatch.setattr(tokcap.files.write_batches, "filesystem_sync_for", counted_sync_for)
    plain = FileStagingSink(tmp_path / "plain")
    journaled, _ = _journaled(tmp_path / "journaled")
    for call in (turn.call for turn in conversation("r1", 3)):
        syncs.clear()
        assert plain.stage(call).ok
        plain_syncs = list(syncs)
        syncs.clear()
        assert journaled.stage(call).ok
        assert syncs == plain_syncs and plain_syncs


def test_pending_rollouts_are_the_committed_ones_not_retired_each_saying_if_it_has_failures(
    tmp_path: Path,
) -> None:
    ledger = FileLineageResolver(tmp_path)
    sink, _ = _journaled(tmp_path)
    for rollout_id in ("clean", "poisoned", "retired", "staged-only", "deleted"):
        for turn in conversation(rollout_id, 2):
            assert sink.stage(turn.call).ok
            if rollout_id != "staged-only":
                asyncio.run(ledger.record(commit_for(turn)))
    asyncio.run(ledger.record_failure("poisoned", "call-9", "worker_capture_failed"))
    asyncio.run(ledger.record_failure("failed-only", "call-0", "worker_capture_failed"))
    asyncio.run(ledger.retire(["retired"]))
    asyncio.run(ledger.delete(["deleted"]))
    assert asyncio.run(ledger.pending_rollouts()) == [
        PendingRollout("clean", has_failures=False),
        PendingRollout("poisoned", has_failures=True),
    ]


def test_staged_rollouts_show_calls_bytes_unledgered_calls_and_age_per_rollout(tmp_path: Path) -> None:
    sink, _ = _journaled(tmp_path)
    ledger = FileLineageResolver(tmp_path)
    turns = conversation("r1", 3)
    for turn in turns:
        assert sink.stage(turn.call, attachments={"image": b"x" * 1000}).ok
    asyncio.run(ledger.record(commit_for(turns[0])))
    asyncio.run(ledger.record_failure("r1", "call-1", "worker_capture_failed"))
    for turn in conversation("gone", 1):
        assert sink.stage(turn.call).ok
    asyncio.run(ledger.retire(["gone"]))
    staged_file = FileStagingSource(tmp_path).journal_store().staged_path_for("r1")
    os.utime(staged_file, (1000.0, 1000.0))
    [status] = staged_rollouts(FileStagingSource(tmp_path), now=1600.0)
    assert (status.rollout_id, status.staged_calls, status.unledgered_calls) == ("r1", 3, 1)
    assert (status.ledger_rows, status.failure_rows) == (1, 1)
    assert status.staged_bytes == staged_file.stat().st_size + 1000
    assert (status.last_staged_at, status.age_s) == (1000.0, 600.0)


def test_the_journal_and_inner_store_must_have_their_shapes(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="StagingSink shape"):
        JournaledStagingSink(object(), FileStagingSink(tmp_path))
    with pytest.raises(InvalidInputError, match="no journal_cursor"):
        JournaledStagingSink(MemoryStagingStore(), MemoryStagingStore())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    [
        '{"label": 3, "taken_at": 1, "transport": "file", "version": 1, "rollouts": {}}',
        '{"label": "x", "taken_at": 1, "transport": "kafka", "version": 1, "topic": 5, "offsets": {}}',
        '{"label": "x", "taken_at": 1, "transport": "ftp", "version": 1}',
        '{"label": "x", "taken_at": 1, "transport": "kafka", "version": 1, "topic": "t", "offsets": {"0": -1}}',
        '{"label": "x", "taken_at": 1, "transport": "file", "version": 1, '
        '"rollouts": {"r": {"size": 1, "slots": "ab"}}}',
    ],
)
def test_a_cursor_with_a_wrong_field_is_refused_naming_it(text: str) -> None:
    with pytest.raises(InvalidInputError, match="not a journal cursor"):
        JournalCursor.from_json(text)


def test_a_kafka_cursor_restages_a_row_at_or_past_its_partitions_offset_and_any_row_it_cannot_place() -> None:
    cursor = JournalCursor("k", "kafka", 0.0, topic="run", offsets={0: 10})
    slot = StagedSlot(start=0, length=1, digest="d", offset=9)
    at = RolloutState(rollout_id="r", last_position=LogPosition("run", 0, 12))
    assert not cursor.restages(at, slot)
    assert cursor.restages(at, slot.model_copy(update={"offset": 10}))
    assert cursor.restages(at, slot.model_copy(update={"offset": None}))
    assert cursor.restages(RolloutState(rollout_id="r", last_position=LogPosition("other", 0, 12)), slot)
    assert cursor.restages(RolloutState(rollout_id="r", last_position=LogPosition("run", 1, 12)), slot)


def test_a_cursor_line_a_crash_cut_short_is_skipped_and_damage_before_the_end_is_reported(
    tmp_path: Path,
) -> None:
    sink, _ = _journaled(tmp_path)
    first = sink.cursor("step-1")
    listed = tmp_path / "tokcap-journal-cursors.jsonl"
    with listed.open("ab") as handle:
        handle.write(b'{"label": "step-2", "ta')
    assert cursors_taken(tmp_path) == [first]
    listed.write_bytes(b"garbage\n" + first.to_json().encode() + b"\n")
    with pytest.raises(InvalidInputError, match="not a journal cursor"):
        cursors_taken(tmp_path)


class _RefusalUnrecorded(FileStagingSink):
    """A journal whose disk fails just when a refusal is to be recorded (fault injection)."""

    def record_refusal(self, rollout_id: str, model_call_id: str) -> None:
        raise OSError(28, "No space left on device")


def test_a_refusal_the_journal_could_not_record_is_reported_in_the_failed_result(tmp_path: Path) -> None:
    sink = JournaledStagingSink(
        MemoryStagingStore(refuse=frozenset({"r1/call-0"})), _RefusalUnrecorded(tmp_path)
    )
    [turn] = conversation("r1", 1)
    result = sink.stage(turn.call)
    assert not result.ok
    assert "recording the refusal in the journal failed too (OSError" in result.error
    assert (
        "until Gym's model server records the call's failure row a restage would give it back" in result.error
    )


def test_a_rollout_retired_while_restage_runs_is_skipped_and_counted(tmp_path: Path) -> None:
    sink, _ = _journaled(tmp_path)
    for rollout_id in ("r1", "r2"):
        for turn in conversation(rollout_id, 2):
            assert sink.stage(turn.call).ok

    class RetiresR2(MemoryStagingStore):
        def stage(self, record: Any, *, attachments: Any = None) -> Any:
            TokenCaptureStore(tmp_path).retire_now(["r2"])
            return super().stage(record, attachments=attachments)

    fresh = RetiresR2()
    report = restage(FileStagingSource(tmp_path), fresh)
    assert (report.restaged, report.retired, report.retired_rollouts) == (2, 1, ("r2",))
    assert sorted(fresh.stored) == ["r1/call-0", "r1/call-1"]


def test_a_damaged_blob_fails_the_restage_instead_of_restaging_without_it(tmp_path: Path) -> None:
    sink, _ = _journaled(tmp_path)
    [turn] = conversation("r1", 1, extras=True)
    assert sink.stage(turn.call, attachments={"image": b"pixels"}).ok
    store = TokenCaptureStore(tmp_path)
    blob = store.blob_path_for("r1", hashlib.sha256(b"pixels").hexdigest())
    blob.write_bytes(b"pixelz")
    with pytest.raises(StoreCorruptionError, match="does not hold the 6 bytes"):
        restage(FileStagingSource(tmp_path), MemoryStagingStore())


class _SnapshottedStore(MemoryStagingStore):
    """A trainer's in-memory store that can be snapshotted and loaded, as the operations guide's wiring uses it."""

    def state(self) -> dict[str, Any]:
        return dict(self.stored)

    def load(self, state: dict[str, Any]) -> None:
        self.stored = dict(state)


def test_the_operations_guides_ten_lines_restore_a_crashed_trainers_store_to_every_acknowledged_call(
    tmp_path: Path,
) -> None:
    guide = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    section = guide[guide.index("## A journal behind a trainer's in-memory staging store") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("```\n", 10)]
    checkpoints: dict[int, Any] = {}

    class Checkpoint:
        def __init__(self, state: dict[str, Any], journal_cursor: str) -> None:
            self.state, self.journal_cursor = state, journal_cursor

    before_crash = _SnapshottedStore()
    names: dict[str, Any] = {
        "transfer_queue": before_crash,
        "STORE": tmp_path,
        "save_checkpoint": lambda step, state, journal_cursor: checkpoints.update(
            {step: Checkpoint(state, journal_cursor)}
        ),
    }
    exec(compile(code, "docs/operations.md", "exec"), names)
    ledger = FileLineageResolver(tmp_path)
    for turn in conversation("r1", 2):
        assert names["sink"].stage(turn.call).ok
        asyncio.run(ledger.record(commit_for(turn)))
    names["snapshot"](10)
    for turn in conversation("r2", 2):
        assert names["sink"].stage(turn.call).ok
    names["transfer_queue"] = restored = _SnapshottedStore()
    asyncio.run(names["restore"](checkpoints[10]))
    assert restored.stored == before_crash.stored and len(restored.stored) == 4
    assert len(restored.given) == 2
    assert asyncio.run(ledger.pending_rollouts()) == [PendingRollout("r1", has_failures=False)]


def test_the_cursors_file_a_cursor_creates_is_made_durable_with_its_directory_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    monkeypatch.setattr(tokcap.staging.journal, "fsync_directory", synced.append)
    for step in range(3):
        record_cursor(tmp_path, JournalCursor(f"step-{step}", "file", 1.0))
    assert synced == [tmp_path]
    assert [cursor.label for cursor in cursors_taken(tmp_path)] == ["step-0", "step-1", "step-2"]

"""Engine-side staging on the file store: staged rows and ledger rows are events of the store, applied by
its rules, durable before the call returns, and read back exactly."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from pathlib import Path

import orjson
import pytest
from staging_calls import Turn, commit_for, conversation, cumulative_tokens, staged_call

from tokcap.errors import (
    ConflictingEntryError,
    InvalidInputError,
    RolloutRetiredError,
    StagingKeyNotFoundError,
    StoreCorruptionError,
)
from tokcap.files import durable_io
from tokcap.files.store import TokenCaptureStore
from tokcap.lineage import FileLineageResolver
from tokcap.log.events import LedgerFailureEvent, StageEvent, decode_event, encode_event
from tokcap.log.records import ParentResolutionStatus
from tokcap.log.rules import ApplyOutcome, decide
from tokcap.log.state import RolloutState
from tokcap.staging import FileStagingSink, FileStagingSource


def _stage_event(key: str = "r/c", row: dict[str, object] | None = None) -> StageEvent:
    return StageEvent(rollout_id="r", staging_key=key, model_call_id="c", row=row or {"n": 1})


# ------------------------------------------------------------------------------------------- rules


def test_a_repeated_stage_is_a_no_op_and_a_different_one_is_rejected_without_change() -> None:
    first = decide(RolloutState(rollout_id="r"), _stage_event(), None)
    assert first.verdict.outcome is ApplyOutcome.ACCEPTED
    again = decide(first.state, _stage_event(), None)
    assert again.verdict.outcome is ApplyOutcome.NOOP and not again.changed
    other = decide(first.state, _stage_event(row={"n": 2}), None)
    assert other.verdict.outcome is ApplyOutcome.CONFLICT and not other.changed
    assert other.state.staged == first.state.staged


def test_a_ledger_failure_repeat_is_a_no_op_and_another_reason_for_the_call_is_rejected() -> None:
    event = LedgerFailureEvent(rollout_id="r", model_call_id="c", reason="worker_capture_failed")
    first = decide(RolloutState(rollout_id="r"), event, None)
    assert first.verdict.outcome is ApplyOutcome.ACCEPTED
    assert decide(first.state, event, None).verdict.outcome is ApplyOutcome.NOOP
    other = event.model_copy(update={"reason": "other"})
    assert decide(first.state, other, None).verdict.outcome is ApplyOutcome.CONFLICT


def test_staging_events_after_a_retire_are_refused_by_the_fence() -> None:
    from tokcap.log.events import RetireEvent

    staged = decide(RolloutState(rollout_id="r"), _stage_event(), None).state
    retired = decide(staged, RetireEvent(rollout_id="r"), None)
    assert retired.verdict.removed is True and dict(retired.state.staged) == {}
    late = decide(retired.state, _stage_event(key="r/d"), None)
    assert late.verdict.outcome is ApplyOutcome.REJECTED_RETIRED


def test_staging_events_round_trip_through_the_canonical_encoding() -> None:
    event = _stage_event(row={"lp": [-0.1234567890123456789, 0.0], "i": 3})
    assert decode_event(encode_event(event)) == event


# ------------------------------------------------------------------------------------ sink and source


def test_staged_rows_come_back_exactly_log_probs_as_float64_and_extras_with_their_json_types(
    tmp_path: Path,
) -> None:
    extras = {
        "routed_experts": [[1, 2], [3, 4]],
        "one": 1,
        "one_float": 1.0,
        "nested": {"x": [0.1, None, True]},
    }
    root = staged_call("r1", "c0", [1, 2, 3], [4, 5], extras=extras)
    result = FileStagingSink(tmp_path).stage(root)
    assert result.ok and result.staging_key == "r1/c0"
    source = FileStagingSource(tmp_path)
    [base] = source.fetch(["r1/c0"])
    # tokcap's class, or Gym's when an earlier test of the session imported Gym: a base row either way.
    assert type(base).__name__ == "StagedCallBaseSnapshot" and "extras" not in type(base).model_fields
    assert base.generation_log_probs_delta == root.generation_log_probs_delta
    assert [float.hex(v) for v in base.generation_log_probs_delta] == [
        float.hex(v) for v in root.generation_log_probs_delta
    ]
    assert base.model_dump() == root.model_dump(exclude={"extras"})
    [full] = source.fetch_full(["r1/c0"])
    assert full.extras == extras
    assert type(full.extras["one"]) is int and type(full.extras["one_float"]) is float
    assert source.fetch_attachments("r1/c0") == {}


def test_attachments_empty_and_many_mib_come_back_byte_for_byte(tmp_path: Path) -> None:
    big = os.urandom(5 * 1024 * 1024)
    call = staged_call("r1", "c0", [1], [2])
    assert FileStagingSink(tmp_path).stage(call, attachments={"empty": b"", "image": big}).ok
    got = FileStagingSource(tmp_path).fetch_attachments("r1/c0")
    assert got == {"empty": b"", "image": big}


def test_fetch_returns_one_snapshot_per_key_in_the_order_asked_and_a_missing_key_raises(
    tmp_path: Path,
) -> None:
    sink = FileStagingSink(tmp_path)
    turns = conversation("ra", 3) + conversation("rb", 2, base=500)
    for turn in turns:
        assert sink.stage(turn.call).ok
    keys = ["rb/call-1", "ra/call-2", "ra/call-0", "rb/call-1"]
    fetched = FileStagingSource(tmp_path).fetch(keys)
    assert [f"{s.rollout_id}/{s.model_call_id}" for s in fetched] == keys
    for missing in (["ra/call-9"], ["nope/call-0"], ["no-slash"]):
        with pytest.raises(StagingKeyNotFoundError):
            FileStagingSource(tmp_path).fetch(missing)


def test_fetch_parses_no_blob_so_a_damaged_blob_fails_only_the_reads_that_return_it(tmp_path: Path) -> None:
    call = staged_call("r1", "c0", [1], [2], extras={"routed_experts": "nrlre1:abc"})
    assert FileStagingSink(tmp_path).stage(call, attachments={"a": b"pixels"}).ok
    for blob in (tmp_path / "r1.tokens.blobs").iterdir():
        blob.write_bytes(b"garbage")
    source = FileStagingSource(tmp_path)
    assert source.fetch(["r1/c0"])[0].digest == call.digest
    with pytest.raises(StoreCorruptionError):
        source.fetch_full(["r1/c0"])
    with pytest.raises(StoreCorruptionError):
        source.fetch_attachments("r1/c0")


def test_a_blob_file_of_the_right_name_and_size_but_other_bytes_is_rewritten_before_its_row_is_acknowledged(
    tmp_path: Path,
) -> None:
    call = staged_call("r1", "c0", [1], [2], extras={"routed_experts": "nrlre1:abc"})
    image = b"pixels" * 1000
    blobs = tmp_path / "r1.tokens.blobs"
    blobs.mkdir()
    torn = blobs / hashlib.sha256(image).hexdigest()
    torn.write_bytes(bytes(len(image)))
    assert FileStagingSink(tmp_path).stage(call, attachments={"image": image}).ok
    assert FileStagingSource(tmp_path).fetch_attachments("r1/c0") == {"image": image}


def test_stage_makes_its_blobs_and_row_durable_before_the_state_naming_them_is_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state file is the commit record: a power loss may keep its rename and lose any unsynced byte, so the
    blobs and the row it names are synced first, and the rename is synced before ``stage`` returns ok."""
    sink = FileStagingSink(tmp_path)
    store = sink._store
    events: list[str] = []
    sync = store.files._commit._sync
    monkeypatch.setattr(store.files._commit, "_sync", lambda: (events.append("sync"), sync())[1])
    rename = durable_io.rename_over

    def logged_rename(tmp: Path, path: Path) -> None:
        events.append("state" if path.name.endswith(".state.json") else "blob")
        rename(tmp, path)

    monkeypatch.setattr(durable_io, "rename_over", logged_rename)
    call = staged_call("r1", "c0", [1], [2], extras={"routed_experts": "nrlre1:abc"})
    assert sink.stage(call, attachments={"image": b"x"}).ok
    assert events == ["blob", "blob", "sync", "state", "sync"]


def test_a_retried_stage_repairs_the_blobs_a_crash_before_its_sync_lost(tmp_path: Path) -> None:
    call = staged_call("r1", "c0", [1], [2], extras={"routed_experts": "nrlre1:abc"})
    image = b"pixels" * 1000
    assert FileStagingSink(tmp_path).stage(call, attachments={"image": image}).ok
    blobs = sorted((tmp_path / "r1.tokens.blobs").iterdir())
    blobs[0].unlink()
    blobs[1].write_bytes(bytes(blobs[1].stat().st_size))
    assert FileStagingSink(tmp_path).stage(call, attachments={"image": image}).ok
    source = FileStagingSource(tmp_path)
    assert source.fetch_full(["r1/c0"])[0].extras == call.extras
    assert source.fetch_attachments("r1/c0") == {"image": image}


def test_a_different_payload_under_a_staged_key_fails_and_the_first_row_stands(tmp_path: Path) -> None:
    sink = FileStagingSink(tmp_path)
    first = staged_call("r1", "c0", [1], [2])
    assert sink.stage(first).ok
    assert FileStagingSink(tmp_path).stage(first).ok
    second = staged_call("r1", "c0", [1], [3])
    result = sink.stage(second)
    assert not result.ok and "different payload" in (result.error or "")
    assert not sink.stage(first, attachments={"x": b"1"}).ok
    assert FileStagingSource(tmp_path).fetch(["r1/c0"])[0].digest == first.digest


def test_staged_input_follows_the_put_input_rules(tmp_path: Path) -> None:
    sink = FileStagingSink(tmp_path)
    with pytest.raises(InvalidInputError, match="control character"):
        sink.stage(staged_call("r1", "bad\ncall", [1], [2]))
    data = staged_call("r1", "c0", [1], [2]).model_dump()
    data["token_ids_delta"] = [2**64, 2]
    with pytest.raises(InvalidInputError, match=r"outside \[0, 2\*\*64\)"):
        sink.stage(data)
    data = staged_call("r1", "c0", [1], [2]).model_dump()
    data["generation_log_probs_delta"] = [0.0, float("nan")]
    with pytest.raises(InvalidInputError, match="nan"):
        sink.stage(data)
    with pytest.raises(InvalidInputError, match="bytes"):
        sink.stage(staged_call("r1", "c0", [1], [2]), attachments={"t": [1, 2]})
    assert not (tmp_path / "r1.tokens.staged").exists()


def test_a_retire_removes_staged_rows_ledger_rows_and_blobs_and_a_late_stage_fails(tmp_path: Path) -> None:
    sink = FileStagingSink(tmp_path)
    turn = conversation("r1", 1, extras=True)[0]
    assert sink.stage(turn.call, attachments={"a": b"x"}).ok
    ledger = FileLineageResolver(tmp_path)
    asyncio.run(ledger.record(commit_for(turn)))
    store = TokenCaptureStore(tmp_path)
    assert store.retire_now(["r1"]).removed == ("r1",)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r1.tokens.lock", "r1.tokens.state.json"]
    late = sink.stage(staged_call("r1", "late", [9], [9]), attachments={"a": b"late"})
    assert not late.ok and "retired" in (late.error or "")
    assert not (tmp_path / "r1.tokens.blobs").exists() or not any((tmp_path / "r1.tokens.blobs").iterdir())
    with pytest.raises(RolloutRetiredError):
        asyncio.run(ledger.record_failure("r1", "late", "worker_capture_failed"))
    with pytest.raises(StagingKeyNotFoundError):
        FileStagingSource(tmp_path).fetch(["r1/call-0"])
    assert store.delete_now(["r1"]).removed == ("r1",)
    assert sink.stage(turn.call).ok


def test_bytes_past_the_committed_staged_size_were_never_acknowledged_and_are_cut(tmp_path: Path) -> None:
    sink = FileStagingSink(tmp_path)
    assert sink.stage(staged_call("r1", "c0", [1], [2])).ok
    with (tmp_path / "r1.tokens.staged").open("ab") as handle:
        handle.write(b'{"torn":')
    assert sink.stage(staged_call("r1", "c1", [1], [3])).ok
    assert [s.model_call_id for s in FileStagingSource(tmp_path).fetch(["r1/c0", "r1/c1"])] == ["c0", "c1"]
    for line in (tmp_path / "r1.tokens.staged").read_bytes().splitlines():
        orjson.loads(line)


def test_stage_from_eight_threads_loses_nothing_and_every_row_is_exact(tmp_path: Path) -> None:
    sink = FileStagingSink(tmp_path)
    rollouts = [conversation(f"t{n}", 4, base=1000 * n, extras=True) for n in range(8)]
    errors: list[BaseException] = []

    def run(turns: list[Turn]) -> None:
        try:
            for turn in turns:
                blob = hashlib.sha256(turn.call.digest.encode()).digest() * 1000
                assert sink.stage(turn.call, attachments={"blob": blob}).ok
                assert sink.stage(turns[0].call, attachments={"blob": _blob_of(turns[0])}).ok
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(turns,)) for turns in rollouts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    source = FileStagingSource(tmp_path)
    for turns in rollouts:
        keys = [f"{t.call.rollout_id}/{t.call.model_call_id}" for t in turns]
        assert [s.model_dump() for s in source.fetch_full(keys)] == [t.call.model_dump() for t in turns]
        assert source.fetch_attachments(keys[-1]) == {"blob": _blob_of(turns[-1])}


def _blob_of(turn: Turn) -> bytes:
    return hashlib.sha256(turn.call.digest.encode()).digest() * 1000


# ------------------------------------------------------------------------------------------- ledger


def test_the_ledger_records_once_and_refuses_any_difference_request_items_included(tmp_path: Path) -> None:
    turn = conversation("r1", 1)[0]
    commit = commit_for(turn)
    asyncio.run(FileLineageResolver(tmp_path).record(commit))
    asyncio.run(FileLineageResolver(tmp_path).record(commit))
    changed = commit.model_copy(
        update={"request_items": [*commit.request_items, {"role": "user", "content": "x"}]}
    )
    with pytest.raises(ConflictingEntryError):
        asyncio.run(FileLineageResolver(tmp_path).record(changed))
    other_response = commit_for(turn, response_id="resp-other")
    with pytest.raises(ConflictingEntryError):
        asyncio.run(FileLineageResolver(tmp_path).record(other_response))
    manifest = asyncio.run(FileLineageResolver(tmp_path).manifest("r1"))
    assert [row["response_id"] for row in manifest["records"]] == ["resp-call-0"]


def test_a_ledger_row_committing_another_payload_than_the_one_staged_under_its_key_is_refused(
    tmp_path: Path,
) -> None:
    [staged] = conversation("r2", 1)
    [other] = conversation("r2", 1, extras=True)
    assert staged.call.digest != other.call.digest
    assert FileStagingSink(tmp_path).stage(staged.call).ok
    with pytest.raises(ConflictingEntryError, match="staged twice with different payloads"):
        asyncio.run(FileLineageResolver(tmp_path).record(commit_for(other)))
    assert asyncio.run(FileLineageResolver(tmp_path).manifest("r2"))["records"] == []
    asyncio.run(FileLineageResolver(tmp_path).record(commit_for(staged)))
    [unstaged_here] = conversation("r3", 1)
    asyncio.run(FileLineageResolver(tmp_path).record(commit_for(unstaged_here)))
    assert len(asyncio.run(FileLineageResolver(tmp_path).manifest("r3"))["records"]) == 1


def test_the_manifest_is_plain_json_with_failures_and_has_rows_counts_failure_rows(tmp_path: Path) -> None:
    ledger = FileLineageResolver(tmp_path)
    assert ledger.is_process_shared() is True
    assert asyncio.run(ledger.has_rows("r1")) is False
    asyncio.run(ledger.record_failure("r1", "c9", "worker_capture_failed"))
    asyncio.run(ledger.record_failure("r1", "c9", "worker_capture_failed"))
    assert asyncio.run(ledger.has_rows("r1")) is True
    turns = conversation("r1", 2)
    for turn in turns:
        asyncio.run(ledger.record(commit_for(turn)))
    manifest = asyncio.run(ledger.manifest("r1"))
    assert orjson.loads(orjson.dumps(manifest)) == manifest
    assert manifest["failures"] == [
        {"schema_version": 2, "model_call_id": "c9", "reason": "worker_capture_failed"}
    ]
    assert [row["model_call_id"] for row in manifest["records"]] == ["call-0", "call-1"]
    assert manifest["records"][1]["chain_hash"] == turns[1].call.chain_hash


def test_resolve_finds_a_committed_parent_by_its_custody_fingerprint_with_chain_and_length(
    tmp_path: Path,
) -> None:
    ledger = FileLineageResolver(tmp_path)
    turns = conversation("r1", 3)
    for turn in turns[:2]:
        asyncio.run(ledger.record(commit_for(turn)))
    asyncio.run(ledger.record_failure("r1", "call-x", "worker_capture_failed"))
    parent = turns[1]
    request = [*parent.request_items, *parent.response_items, {"role": "user", "content": "next"}]
    resolution = asyncio.run(FileLineageResolver(tmp_path).resolve("r1", request))
    assert resolution.status is ParentResolutionStatus.RESOLVED and resolution.match is not None
    assert resolution.match.model_call_id == "call-1"
    assert resolution.match.staging_chain == ("r1/call-0", "r1/call-1")
    assert resolution.match.prev_len == parent.call.cum_len == len(cumulative_tokens(parent.call))
    assert resolution.match.chain_hash == parent.call.chain_hash
    stranger = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "never said"}]
    assert asyncio.run(ledger.resolve("r1", stranger)).status is ParentResolutionStatus.UNRESOLVED


def test_sixteen_threads_staging_into_one_rollout_lose_no_row(tmp_path: Path) -> None:
    sink = FileStagingSink(tmp_path)
    calls = [staged_call("one", f"c{index}", [index], [index + 1000]) for index in range(160)]

    def run(offset: int) -> None:
        for call in calls[offset::16]:
            assert sink.stage(call).ok

    threads = [threading.Thread(target=run, args=(offset,)) for offset in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fetched = FileStagingSource(tmp_path).fetch([f"one/c{index}" for index in range(160)])
    assert [snapshot.digest for snapshot in fetched] == [call.digest for call in calls]


def test_the_ledger_retires_a_read_rollout_so_late_stages_and_records_fail_and_delete_frees_the_id(
    tmp_path: Path,
) -> None:
    turns = conversation("r1", 2)
    ledger, sink = FileLineageResolver(tmp_path), FileStagingSink(tmp_path)
    for turn in turns:
        assert sink.stage(turn.call).ok
        asyncio.run(ledger.record(commit_for(turn)))
    assert asyncio.run(ledger.retire(["r1", "r2"])) == {"removed": ["r1"], "absent": ["r2"]}
    assert asyncio.run(ledger.retire(["r1"])) == {"removed": [], "absent": ["r1"]}
    assert asyncio.run(ledger.manifest("r1"))["records"] == []
    assert not sink.stage(staged_call("r1", "late", [1], [2])).ok
    with pytest.raises(RolloutRetiredError):
        asyncio.run(ledger.record(commit_for(turns[0])))
    assert asyncio.run(ledger.delete(["r1"])) == {"removed": ["r1"], "absent": []}
    assert sink.stage(turns[0].call).ok


def test_a_blob_written_while_a_retire_removes_the_blobs_does_not_fail_the_retire(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = FileStagingSink(tmp_path)
    assert sink.stage(staged_call("r1", "c0", [1], [2]), attachments={"a": b"x"}).ok
    real_listdir = os.listdir

    def listdir_then_a_late_blob(path: object) -> list[str]:
        names = real_listdir(path)  # type: ignore[call-overload]
        if str(path).endswith(".tokens.blobs"):
            (Path(str(path)) / ("f" * 64)).write_bytes(b"late")
        return names  # type: ignore[no-any-return]

    monkeypatch.setattr("tokcap.files.rollout_files.os.listdir", listdir_then_a_late_blob)
    assert TokenCaptureStore(tmp_path).retire_now(["r1"]).removed == ("r1",)
    monkeypatch.undo()
    assert not sink.stage(staged_call("r1", "late", [1], [2])).ok
    assert TokenCaptureStore(tmp_path).delete_now(["r1"]).removed == ("r1",)
    assert not (tmp_path / "r1.tokens.blobs").exists()


def test_a_state_writes_staging_keys_only_with_staging_rows_and_a_newer_schema_is_refused(
    tmp_path: Path,
) -> None:
    from tokcap.errors import NewerSchemaError
    from tokcap.log.state import STATE_SCHEMA_VERSION

    TokenCaptureStore(tmp_path).mark_incomplete_now("plain", "c", "lost")
    assert FileStagingSink(tmp_path).stage(staged_call("staged", "c0", [1], [2])).ok
    plain = orjson.loads((tmp_path / "plain.tokens.state.json").read_bytes())
    staged = orjson.loads((tmp_path / "staged.tokens.state.json").read_bytes())
    assert plain["tokcap"]["schema_version"] == 3 and "staged" not in plain["tokcap"]
    assert staged["tokcap"]["schema_version"] == 3 and list(staged["tokcap"]["staged"]) == ["staged/c0"]
    staged["tokcap"]["schema_version"] = STATE_SCHEMA_VERSION + 1
    with pytest.raises(NewerSchemaError):
        RolloutState.decode(orjson.dumps(staged), "staged.tokens.state.json", "staged")

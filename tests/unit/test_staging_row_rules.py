"""Staging events read back get the checks of their API, and a manifest answers for every rollout it is asked."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from staging_calls import commit_for, conversation, staged_call

from tokcap.errors import InvalidInputError
from tokcap.files.store import TokenCaptureStore
from tokcap.ledger import UNNAMED_CALL, ledger_event, ledger_row
from tokcap.lineage import FileLineageResolver
from tokcap.log.events import IncompleteEvent, LedgerEvent, LedgerFailureEvent, StageEvent
from tokcap.log.input_rules import check_event
from tokcap.staging import finalize_rollout
from tokcap.staging.file_source import FileStagingSource
from tokcap.staging.row_rules import LEDGER_COLUMNS


def _ledger(**changes: Any) -> LedgerEvent:
    event = ledger_event(commit_for(conversation("r1", 1)[0]))
    return event.model_copy(update={"row": {**event.row, **changes}})


def _stage(key: str = "r1/c1", **changes: Any) -> StageEvent:
    row = staged_call("r1", "c1", [1, 2], [3]).model_dump(mode="json", exclude={"extras"})
    return StageEvent(rollout_id="r1", staging_key=key, model_call_id="c1", row={**row, **changes})


REFUSED = [
    (_ledger().model_copy(update={"row": {}}), "lacks column"),
    (_ledger().model_copy(update={"model_call_id": "a\nb"}), "control character"),
    (_ledger().model_copy(update={"model_call_id": ""}), "model_call_id is empty"),
    (_ledger(extra="x"), "unknown column(s) ['extra']"),
    (_ledger(staging_digest="xyz"), "column 'staging_digest'"),
    (_ledger(cum_len=-1), "column 'cum_len'"),
    (_ledger(digest="0" * 64), "column 'digest'"),
    (_ledger(context_len=True), "column 'context_len'"),
    (_ledger(fingerprint=5), "column 'fingerprint'"),
    (_ledger(staging_chain=["r1/call-0", ""]), "column 'staging_chain'"),
    (LedgerFailureEvent(rollout_id="r1", model_call_id="c1", reason=""), "reason is empty"),
    (LedgerFailureEvent(rollout_id="r1", model_call_id="c\x00", reason="lost"), "control character"),
    (_stage(key="r2/c1"), "staging_key"),
    (_stage(model_call_id="c2"), "model_call_id"),
    (_stage(digest="0" * 63), "column 'digest'"),
    (_stage(token_mask_delta=[0.0, "1", 1.0]), "column 'token_mask_delta"),
    (_stage(extras={"a": 1}), "column 'extras'"),
    (_stage(token_ids_delta=[1, 2, 2**64]), "token_ids_delta"),
]


@pytest.mark.parametrize(("event", "fragment"), REFUSED)
def test_a_staging_event_its_api_would_not_send_is_refused_naming_the_column(
    event: StageEvent | LedgerEvent | LedgerFailureEvent, fragment: str
) -> None:
    with pytest.raises(InvalidInputError) as refused:
        check_event(event)
    assert fragment in str(refused.value)


def test_the_events_the_api_sends_pass_the_rules_read_back() -> None:
    turn = conversation("r1", 2)[1]
    assert set(ledger_row(commit_for(turn))) == LEDGER_COLUMNS
    for event in (
        ledger_event(commit_for(turn)),
        _stage(),
        LedgerFailureEvent(rollout_id="r1", model_call_id="c1", reason="lost"),
    ):
        assert check_event(event) is event


def _recorded(root: Path) -> tuple[TokenCaptureStore, FileLineageResolver]:
    store, ledger = TokenCaptureStore(root), FileLineageResolver(root)
    [turn] = conversation("r1", 1)
    store.apply(_stage_of(turn.call))
    asyncio.run(ledger.record(commit_for(turn)))
    return store, ledger


def _stage_of(call: Any) -> StageEvent:
    return StageEvent(
        rollout_id=call.rollout_id,
        staging_key=f"{call.rollout_id}/{call.model_call_id}",
        model_call_id=call.model_call_id,
        row=call.model_dump(mode="json", exclude={"extras"}),
    )


def test_a_ledger_row_without_its_columns_in_a_store_masks_the_manifest_instead_of_raising(
    tmp_path: Path,
) -> None:
    store, ledger = _recorded(tmp_path)
    # Applied by a reader that did not check rows yet: the projection holds it.
    store.apply(LedgerEvent(rollout_id="r1", model_call_id="call-9", commit_digest="0" * 64, row={}))
    manifest = asyncio.run(ledger.manifest("r1"))
    assert [record["model_call_id"] for record in manifest["records"]] == ["call-0"]
    [failure] = manifest["failures"]
    assert failure["model_call_id"] == "call-9" and "lacks column" in failure["reason"]
    done = finalize_rollout(manifest, FileStagingSource(tmp_path))
    assert done.masked and "lacks column" in (done.masked_reason or "")


def test_a_ledger_line_damaged_on_disk_masks_the_manifest_instead_of_raising(tmp_path: Path) -> None:
    store, ledger = _recorded(tmp_path)
    path = store.path_for("r1").with_suffix(".ledger")
    data = path.read_bytes()
    path.write_bytes(b"[" + data[1:])  # same length, the call id still in place, no longer JSON
    manifest = asyncio.run(ledger.manifest("r1"))
    assert manifest["records"] == []
    [failure] = manifest["failures"]
    assert failure["model_call_id"] == UNNAMED_CALL and "ledger line 1 cannot be read" in failure["reason"]
    assert ledger.staged_resolution("r1", conversation("r1", 2)[1].request_items) is None


def test_a_ledger_that_no_longer_matches_its_state_masks_the_manifest_instead_of_raising(
    tmp_path: Path,
) -> None:
    store, ledger = _recorded(tmp_path)
    path = store.path_for("r1").with_suffix(".ledger")
    path.write_bytes(path.read_bytes()[:-5])
    [failure] = asyncio.run(ledger.manifest("r1"))["failures"]
    assert failure["model_call_id"] == UNNAMED_CALL and "restore it or replay the run" in failure["reason"]


def test_a_masked_rollouts_manifest_says_why(tmp_path: Path) -> None:
    store, ledger = _recorded(tmp_path)
    store.apply(
        IncompleteEvent(rollout_id="r1", model_call_id="call-1", reason="dead-lettered event: bad row")
    )
    store.apply(IncompleteEvent(rollout_id="r1", reason="a lost marker"))
    failures = asyncio.run(ledger.manifest("r1"))["failures"]
    assert [(failure["model_call_id"], failure["reason"]) for failure in failures] == [
        ("call-1", "dead-lettered event: bad row"),
        (UNNAMED_CALL, "a lost marker"),
    ]


@pytest.mark.parametrize(
    ("written", "fragment"),
    [
        (b'{"failure_reason":"","model_call_id":"c9"}', "reason"),
        (b"[1, 2]", "not an object"),
        (b'{"failure_reason":"lost!","model_call_id":9}', "not a str"),
    ],
)
def test_a_failure_line_rewritten_on_disk_masks_the_manifest_instead_of_raising(
    tmp_path: Path, written: bytes, fragment: str
) -> None:
    store, ledger = _recorded(tmp_path)
    asyncio.run(ledger.record_failure("r1", "c9", "lost!"))
    path = store.path_for("r1").with_suffix(".ledger")
    first, failure = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(first + written.ljust(len(failure) - 1) + b"\n")
    manifest = asyncio.run(ledger.manifest("r1"))
    assert [record["model_call_id"] for record in manifest["records"]] == ["call-0"]
    [damaged] = manifest["failures"]
    assert "ledger line 2 cannot be read" in damaged["reason"] and fragment in damaged["reason"]

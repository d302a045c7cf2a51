"""A trainer's last step without Gym: manifest to receipt, then one verified row or a masked placeholder."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from staging_calls import commit_for, conversation, cumulative_tokens

from tokcap.errors import StoreCorruptionError
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, FileStagingSource, finalize_rollout, receipt_from_manifest


def _staged_rollout(root: Path, rollout_id: str, turns: int = 3) -> FileLineageResolver:
    sink, ledger = FileStagingSink(root), FileLineageResolver(root)
    for turn in conversation(rollout_id, turns):
        assert sink.stage(turn.call).ok
        asyncio.run(ledger.record(commit_for(turn)))
    return ledger


def test_a_complete_rollout_finalizes_to_one_verified_row_with_its_exact_tokens(tmp_path: Path) -> None:
    ledger = _staged_rollout(tmp_path, "r1")
    manifest = asyncio.run(ledger.manifest("r1"))
    done = finalize_rollout(manifest, FileStagingSource(tmp_path))
    last = conversation("r1", 3)[-1].call
    assert not done.masked and done.row is not None
    assert done.row.token_ids == cumulative_tokens(last)
    assert done.row.model_call_ids == ["call-0", "call-1", "call-2"]


def test_the_response_the_agent_kept_names_the_terminal_call(tmp_path: Path) -> None:
    manifest = asyncio.run(_staged_rollout(tmp_path, "r1").manifest("r1"))
    receipt = receipt_from_manifest(manifest, response_id="resp-call-1")
    assert receipt.terminal_model_call_id == "call-1" and receipt.terminal_selection == "response_id"
    done = finalize_rollout(manifest, FileStagingSource(tmp_path), response_id="resp-call-1")
    assert done.row is not None and done.row.model_call_ids == ["call-0", "call-1"]
    unknown = finalize_rollout(manifest, FileStagingSource(tmp_path), response_id="resp-nobody")
    assert unknown.masked and "names 0 manifest rows" in (unknown.masked_reason or "")


def test_a_failure_row_masks_the_rollout(tmp_path: Path) -> None:
    ledger = _staged_rollout(tmp_path, "r1")
    asyncio.run(ledger.record_failure("r1", "call-3", "worker_capture_failed"))
    done = finalize_rollout(asyncio.run(ledger.manifest("r1")), FileStagingSource(tmp_path))
    assert done.masked and done.row is None and "worker_capture_failed" in (done.masked_reason or "")


def test_a_staged_row_lost_or_rewritten_masks_the_rollout_and_is_never_delivered(tmp_path: Path) -> None:
    ledger = _staged_rollout(tmp_path, "r1")
    manifest = asyncio.run(ledger.manifest("r1"))
    lost = dict(
        manifest, records=[*manifest["records"][:-1], dict(manifest["records"][-1], staging_key="r1/gone")]
    )
    assert finalize_rollout(lost, FileStagingSource(tmp_path)).masked
    staged = tmp_path / "r1.tokens.staged"
    staged.write_bytes(staged.read_bytes().replace(b'"token_ids_delta":[120', b'"token_ids_delta":[121'))
    damaged = finalize_rollout(manifest, FileStagingSource(tmp_path))
    assert damaged.masked and damaged.row is None


def test_a_staged_record_changed_after_it_was_built_is_refused_when_read_and_its_rollout_is_masked(
    tmp_path: Path,
) -> None:
    sink, ledger = FileStagingSink(tmp_path), FileLineageResolver(tmp_path)
    turns = conversation("r1", 2, extras=True)
    for number, turn in enumerate(turns):
        call = turn.call.model_copy(deep=True)
        if number == 1:
            call.generation_log_probs_delta[-1] = -0.5
        assert sink.stage(call).ok
        asyncio.run(ledger.record(commit_for(turn)))
    source = FileStagingSource(tmp_path)
    with pytest.raises((ValueError, StoreCorruptionError)):
        source.fetch(["r1/call-1"])
    done = finalize_rollout(asyncio.run(ledger.manifest("r1")), source)
    assert done.masked and done.row is None


def test_extras_changed_after_the_record_was_built_are_refused_by_the_full_read(tmp_path: Path) -> None:
    call = conversation("r1", 1, extras=True)[0].call.model_copy(deep=True)
    assert call.extras is not None
    call.extras["n"] = 7
    assert FileStagingSink(tmp_path).stage(call).ok
    source = FileStagingSource(tmp_path)
    assert source.fetch(["r1/call-0"])[0].digest == call.digest
    with pytest.raises((ValueError, StoreCorruptionError)):
        source.fetch_full(["r1/call-0"])

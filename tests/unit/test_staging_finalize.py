"""A trainer's last step without Gym: manifest to receipt, then one verified row or a masked placeholder."""

from __future__ import annotations

import asyncio
from pathlib import Path

from staging_calls import commit_for, conversation, cumulative_tokens

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

"""``tokcap inspect``: what a store directory holds, and what the trainer would make of one rollout.

The verdict comes from the consumer's own code (``trajectories_from_source``) run over a read-only view of
the rollout, so ``inspect`` and the trainer cannot disagree about whether a rollout is masked.
A rollout that is still open is judged as if it were frozen now; nothing is frozen or written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from tokcap.builder import BuildOutput, Chain
from tokcap.consumer import TrajectoryResult, trajectories_from_source
from tokcap.delta_records import lineage_report
from tokcap.errors import InvalidInputError, StoreCorruptionError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.rollout_ids import validate_rollout_id
from tokcap.log.state import RolloutState
from tokcap.protocols import TokenCaptureSnapshot

__all__ = [
    "PreviewSource",
    "RolloutSummary",
    "SideFiles",
    "describe_rollout",
    "describe_store",
    "intent_status",
    "open_existing_store",
    "summarize_rollout",
]


def open_existing_store(directory: Path) -> TokenCaptureStore:
    """Open a store directory that must already exist; the store itself would create a missing one."""
    if not directory.exists():
        raise InvalidInputError(f"store directory {directory} does not exist")
    if not directory.is_dir():
        raise InvalidInputError(f"{directory} is not a directory")
    return TokenCaptureStore(directory)


@dataclass(frozen=True)
class RolloutSummary:
    """One row of the store table."""

    rollout_id: str
    state: str
    incomplete: bool
    entries: int
    prompt_tokens: int
    generated_tokens: int
    version: int
    snapshot_id: str | None
    rejections: int
    staged: int
    ledger_rows: int
    ledger_failures: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form."""
        return dict(self.__dict__)


def summarize_rollout(store: TokenCaptureStore, rollout_id: str) -> RolloutSummary:
    """State, entry count and token counts of one rollout, read without changing anything it means."""
    state = store.read_state(rollout_id)
    entries = [] if state.retired else store.read_entries(rollout_id)
    incomplete = store.is_incomplete(rollout_id)
    return RolloutSummary(
        rollout_id=rollout_id,
        state=state.lifecycle.value,
        incomplete=incomplete,
        entries=len(entries),
        prompt_tokens=sum(len(entry.prompt_token_ids) for entry in entries),
        generated_tokens=sum(len(entry.generation_token_ids) for entry in entries),
        version=state.version,
        snapshot_id=state.snapshot_id,
        rejections=len(state.rejections),
        staged=len(state.staged),
        ledger_rows=len(state.ledger),
        ledger_failures=len(state.ledger_failures),
    )


SideFiles = Callable[[Path], dict[str, Any]]
"""What a transport's readers left in a store directory besides the rollouts, keyed as ``--json`` prints it."""


def describe_store(directory: Path, side_files: SideFiles | None = None) -> dict[str, Any]:
    """Every rollout of a store, plus what ``side_files`` (a mounted transport's) finds beside them."""
    store = open_existing_store(directory)
    rollouts = [summarize_rollout(store, rollout_id) for rollout_id in store.rollout_ids()]
    return {
        "store_dir": str(directory),
        "rollouts": [summary.to_dict() for summary in rollouts],
        **(side_files(directory) if side_files is not None else {}),
    }


class PreviewSource:
    """A read-only ``TokenSource`` over one store: ``freeze`` returns the snapshot a freeze would give now.

    A frozen rollout returns its real snapshot; an open one returns its current entries, incomplete if a call
    was marked lost or an intent is still dangling.
    ``drop`` refuses: inspecting never retires anything.
    """

    NOT_FROZEN = "(not frozen)"

    def __init__(self, store: TokenCaptureStore) -> None:
        self._store = store

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """The rollout's snapshot, real or as it would be if frozen now."""
        state = self._store.read_state(rollout_id)
        if not state.is_open:
            return self._store.snapshot(rollout_id)
        entries = tuple(self._store.read_entries(rollout_id))
        captured = {entry.model_call_id for entry in entries}
        dangling = [call for call, op in intent_status(self._store, rollout_id).items() if op == "intent"]
        incomplete = self._store.is_incomplete(rollout_id) or any(call not in captured for call in dangling)
        return TokenCaptureSnapshot(
            rollout_id=rollout_id,
            entries=entries,
            incomplete=incomplete,
            snapshot_id=self.NOT_FROZEN,
            version=state.version,
        )

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Inspecting never retires; a caller that tries has a bug."""
        raise InvalidInputError("tokcap inspect is read-only and never drops a snapshot")

    async def close(self) -> None:
        """Nothing to release."""


def intent_status(store: TokenCaptureStore, rollout_id: str) -> dict[str, str]:
    """The last intent operation (``intent`` or ``cancel``) recorded for each call of a rollout."""
    return {call_id: op.value for call_id, op in store.read_intents(rollout_id).items()}


@contextmanager
def _quiet_consumer_logs() -> Iterator[None]:
    """The consumer logs every mask as a warning; inspect reports the verdict itself."""
    logger = logging.getLogger("tokcap.consumer")
    previous = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(previous)


def _chain_dict(chain: Chain) -> dict[str, Any]:
    links = []
    for index, link in enumerate(chain.links):
        entry = link.entry
        links.append(
            {
                "model_call_id": entry.model_call_id,
                "context_tokens": len(chain.root_prompt_token_ids)
                if index == 0
                else len(link.interstitial_token_ids),
                "generated_tokens": len(entry.generation_token_ids),
            }
        )
    return {"chain_id": chain.chain_id, "links": links}


def _build_dict(build: BuildOutput | None) -> dict[str, Any] | None:
    if build is None:
        return None
    main = build.main_chain
    return {
        "builder": build.notes.builder,
        "roots": build.notes.roots,
        "chains": build.notes.chains,
        "main_chain": _chain_dict(main) if main is not None else None,
        "branch_chain_ids": list(build.branch_chain_ids),
        "chain_call_ids": [list(chain.call_ids) for chain in build.chains],
        "discarded_retries": list(build.notes.discarded_retries),
        "unresolved_retries": [list(group) for group in build.notes.unresolved_retries],
        "quarantined_call_ids": list(build.quarantined_call_ids),
        "unresolved_parent_calls": list(build.notes.unresolved_parent_calls),
        "empty_generation_calls": list(build.notes.empty_generation_calls),
    }


def _verdict(result: TrajectoryResult) -> dict[str, Any]:
    tokens = result.response["usage"]["total_tokens"] if result.response is not None else 0
    return {"masked": result.masked, "mask_reasons": list(result.mask_reasons), "sequence_tokens": tokens}


def describe_rollout(directory: Path, rollout_id: str) -> dict[str, Any]:
    """One rollout in full: state, entries, intents, incomplete reasons, rejections, chain and verdict."""
    store = open_existing_store(directory)
    rollout_id = validate_rollout_id(rollout_id)
    if rollout_id not in store.rollout_ids():
        raise InvalidInputError(f"rollout {rollout_id!r} has no files in {directory}")
    state: RolloutState = store.read_state(rollout_id)
    entries = [] if state.retired else store.read_entries(rollout_id)
    lineage = lineage_report(entries)
    with _quiet_consumer_logs():
        result = (
            None if state.retired else asyncio.run(trajectories_from_source(rollout_id, PreviewSource(store)))
        )
    return {
        "rollout_id": rollout_id,
        "store_dir": str(directory),
        "state": state.lifecycle.value,
        "snapshot_id": state.snapshot_id,
        "version": state.version,
        "incomplete": store.is_incomplete(rollout_id),
        "last_position": None if state.last_position is None else state.last_position.to_dict(),
        "entries": [
            {
                "model_call_id": entry.model_call_id,
                "parent_call_id": entry.parent_call_id,
                "parent_resolution": None
                if entry.parent_resolution is None
                else entry.parent_resolution.value,
                "parent_resolution_reason": entry.parent_resolution_reason,
                "model": entry.model,
                "prompt_tokens": len(entry.prompt_token_ids),
                "prompt_is_delta": entry.prompt_is_delta,
                "full_prompt_tokens": lineage.full_prompt_tokens.get(entry.model_call_id),
                "generated_tokens": len(entry.generation_token_ids),
                "created_at": entry.created_at,
            }
            for entry in sorted(entries, key=lambda entry: (entry.created_at, entry.model_call_id))
        ],
        "lineage": lineage.to_dict(),
        "intents": intent_status(store, rollout_id),
        "dangling_intents": list(state.dangling_intents),
        "incomplete_reasons": [mark.model_dump() for mark in store.read_incomplete_marks(rollout_id)],
        "rejections": [rejection.model_dump(mode="json") for rejection in state.rejections],
        "build": _build_dict(result.build) if result is not None else None,
        "verdict": _verdict(result) if result is not None else None,
        **_staging(store, directory, rollout_id, state),
    }


def _staging(
    store: TokenCaptureStore, directory: Path, rollout_id: str, state: RolloutState
) -> dict[str, Any]:
    """The rollout's staged calls and ledger rows, and what a trainer would make of them (engine-side staging)."""
    if state.retired or not (state.staged or state.ledger or state.ledger_failures):
        return {
            "staged": [],
            "ledger": [],
            "ledger_failures": [],
            "staging_verdict": None,
            "staging_chain": [],
        }
    keys = sorted(state.staged, key=lambda key: state.staged[key].start)
    staged = []
    for key, line in zip(keys, store.read_staged_lines(rollout_id, keys), strict=True):
        stored = orjson.loads(line) if line is not None else {}
        row = stored.get("row", {})
        masks = row.get("token_mask_delta", [])
        staged.append(
            {
                "staging_key": key,
                "model_call_id": row.get("model_call_id"),
                "parent_call_id": row.get("parent_call_id"),
                "prompt_tokens": sum(mask == 0.0 for mask in masks),
                "generated_tokens": sum(mask == 1.0 for mask in masks),
                "cum_len": row.get("cum_len"),
                "weight_version": row.get("weight_version"),
                "extras_bytes": (stored.get("extras") or {}).get("size"),
                "attachments": {name: ref["size"] for name, ref in stored.get("attachments", {}).items()},
            }
        )
    from tokcap.lineage import FileLineageResolver
    from tokcap.staging import FileStagingSource, finalize_rollout

    try:
        manifest = FileLineageResolver(directory).manifest_now(rollout_id)
        done = finalize_rollout(manifest, FileStagingSource(directory))
    except (StoreCorruptionError, ValueError) as exc:
        return {
            "staged": staged,
            "ledger": [],
            "ledger_failures": [],
            "staging_verdict": f"masked: {exc}",
            "staging_chain": [],
        }
    return {
        "staged": staged,
        "ledger": [
            {
                "model_call_id": row["model_call_id"],
                "parent_call_id": row["parent_call_id"],
                "staging_key": row["staging_key"],
                "cum_len": row["cum_len"],
                "response_id": row["response_id"],
            }
            for row in manifest["records"]
        ],
        "ledger_failures": manifest["failures"],
        "staging_verdict": f"masked: {done.masked_reason}" if done.masked else "trained",
        "staging_chain": [] if done.row is None else list(done.row.model_call_ids),
    }

"""``tokcap staging status``: what the staging journal holds that no trainer has retired yet.

Per rollout with staged calls not retired (``tokcap.staging.staged_rollouts``): how many, their bytes (rows and
blobs), how old they are, its ledger rows and failure rows, and each staged call that has no ledger row at all:
a model server that died after its worker staged leaves such rows, and nothing retires them until an operator
does. Then the rollouts a restored trainer would train on (what ``pending_rollouts()`` answers: a committed
ledger row, not retired, and whether it has failure rows) and the cursors trainers took.

Ages: the file store keeps no time per staged row, so a rollout's age is the time since its staged file last
changed, which every staged call of it is at least as old as (``age_basis: last-write``). Over Kafka each
staged call's age is its stage message's broker timestamp (``age_basis: message-time``), read by the
transport's part of the command.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from tokcap.cli.inspect import open_existing_store
from tokcap.errors import InvalidInputError
from tokcap.files.store import TokenCaptureStore
from tokcap.ledger import pending_in
from tokcap.staging import FileStagingSource, StagedRollout, cursors_taken, staged_rollouts

__all__ = [
    "AGE_BY_LAST_WRITE",
    "AGE_BY_MESSAGE_TIME",
    "StagedTimes",
    "describe_staging",
    "listed_cursors",
    "render_staging_status",
    "staging_status",
]

AGE_BY_LAST_WRITE = "last-write"
"""A rollout's age is the time since its staged file last changed: every staged call is at least that old."""

AGE_BY_MESSAGE_TIME = "message-time"
"""Each staged call's age is its stage message's timestamp in the log."""

StagedTimes = Mapping[str, float]
"""When each staged call was staged (seconds since the epoch), by staging key, where the transport knows it."""


def _call_bytes(store: TokenCaptureStore, rollout_id: str, keys: Sequence[str]) -> list[int]:
    """Each staged call's bytes: its row line, its extras and its attachments."""
    sizes = []
    for line in store.read_staged_lines(rollout_id, keys):
        if line is None:
            sizes.append(0)
            continue
        stored = orjson.loads(line)
        blobs = [] if stored.get("extras") is None else [stored["extras"]]
        blobs += list(stored.get("attachments", {}).values())
        sizes.append(len(line) + sum(int(blob["size"]) for blob in blobs))
    return sizes


def _age(now: float, at: float | None) -> float | None:
    return None if at is None else round(max(0.0, now - at), 3)


def _rollout_status(
    store: TokenCaptureStore, rollout: StagedRollout, now: float, times: StagedTimes | None
) -> dict[str, Any]:
    """One rollout's line: ``staged_rollouts``' figures, aged by ``times`` where given, and its calls no ledger
    or failure row names, each with its bytes and age."""
    state = store.read_state(rollout.rollout_id)
    keys = sorted(state.staged, key=lambda key: state.staged[key].start)
    recorded = set(state.ledger) | set(state.ledger_failures)
    unrecorded = [key for key in keys if key.partition("/")[2] not in recorded]

    def staged_at(key: str) -> float | None:
        return rollout.last_staged_at if times is None else times.get(key)

    known = [at for key in keys if (at := staged_at(key)) is not None]
    return {
        "rollout_id": rollout.rollout_id,
        "staged_calls": rollout.staged_calls,
        "staged_bytes": rollout.staged_bytes,
        "age_s": _age(now, min(known)) if known else None,
        "ledger_rows": rollout.ledger_rows,
        "failure_rows": rollout.failure_rows,
        "unledgered": [
            {"staging_key": key, "bytes": size, "age_s": _age(now, staged_at(key))}
            for key, size in zip(unrecorded, _call_bytes(store, rollout.rollout_id, unrecorded), strict=True)
        ],
    }


def describe_staging(
    root: Path,
    *,
    times: StagedTimes | None = None,
    cursors: Sequence[Mapping[str, Any]] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The staging status of a store directory (a file store, or a projection of a run topic).

    ``times``: when each staged call was staged, where the transport knows it; without it a rollout's age is
    the time since its staged file last changed. ``cursors``: the journal cursors taken, as the transport
    lists them (by default those recorded in the directory: the file journal's own).
    """
    store = open_existing_store(root)
    now = time.time() if now is None else now
    rollouts = [
        _rollout_status(store, rollout, now, times)
        for rollout in staged_rollouts(FileStagingSource(root), now=now)
    ]
    pending = [
        {"rollout_id": rollout.rollout_id, "has_failures": rollout.has_failures}
        for rollout in pending_in(store)
    ]
    taken = (
        [orjson.loads(cursor.to_json()) for cursor in cursors_taken(root)]
        if cursors is None
        else list(cursors)
    )
    return {
        "store_dir": str(root),
        "age_basis": AGE_BY_LAST_WRITE if times is None else AGE_BY_MESSAGE_TIME,
        "rollouts": rollouts,
        "pending_rollouts": pending,
        "cursors": taken,
        "totals": {
            "rollouts": len(rollouts),
            "staged_calls": sum(r["staged_calls"] for r in rollouts),
            "staged_bytes": sum(r["staged_bytes"] for r in rollouts),
            "unledgered_calls": sum(len(r["unledgered"]) for r in rollouts),
            "pending_rollouts": len(pending),
            "cursors": len(taken),
        },
    }


def listed_cursors(directory: Path) -> list[dict[str, Any]]:
    """The cursors a ``JournaledStagingSink`` recorded in ``directory``, oldest first, as JSON objects."""
    if not directory.is_dir():
        raise InvalidInputError(f"cursor directory {directory} does not exist or is not a directory")
    return [orjson.loads(cursor.to_json()) for cursor in cursors_taken(directory)]


def staging_status(directory: Path, cursors: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """``tokcap staging status DIR``: the status of a file store; its own cursors unless ``cursors`` is given."""
    return describe_staging(directory, cursors=cursors)


def _bytes(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _seconds(age: float | None) -> str:
    if age is None:
        return "-"
    if age < 120:
        return f"{age:.0f} s"
    if age < 7200:
        return f"{age / 60:.0f} min"
    return f"{age / 3600:.1f} h"


def render_staging_status(status: Mapping[str, Any], console: Console) -> None:
    """A table of rollouts, then each staged call without a ledger row, the pending rollouts and the cursors."""
    where = status.get("topic") or status["store_dir"]
    basis = "since the last write" if status["age_basis"] == AGE_BY_LAST_WRITE else "oldest staged call"
    table = Table(title=f"staged, not retired, in {where}", title_justify="left")
    for column in (
        "rollout",
        "staged calls",
        "bytes",
        f"age ({basis})",
        "ledger rows",
        "failures",
        "no ledger row",
    ):
        table.add_column(column, justify="left" if column == "rollout" else "right")
    for rollout in status["rollouts"]:
        table.add_row(
            rollout["rollout_id"],
            str(rollout["staged_calls"]),
            _bytes(rollout["staged_bytes"]),
            _seconds(rollout["age_s"]),
            str(rollout["ledger_rows"]),
            str(rollout["failure_rows"]),
            str(len(rollout["unledgered"])),
        )
    console.print(table)
    totals = status["totals"]
    console.print(
        f"{totals['rollouts']} rollouts, {totals['staged_calls']} staged calls, {_bytes(totals['staged_bytes'])}; "
        f"{totals['unledgered_calls']} staged calls without a ledger row"
    )
    for rollout in status["rollouts"]:
        for call in rollout["unledgered"]:
            console.print(
                f"no ledger row: {call['staging_key']} ({_bytes(call['bytes'])}, {_seconds(call['age_s'])} old): "
                "its model server never recorded it; retire the rollout once no trainer needs it"
            )
    pending = status["pending_rollouts"]
    names = ", ".join(p["rollout_id"] + (" (failure rows)" if p["has_failures"] else "") for p in pending)
    console.print(
        f"pending rollouts (committed, not retired): {len(pending)}" + (f": {names}" if names else "")
    )
    cursors = status["cursors"]
    console.print(f"cursors taken: {len(cursors)}")
    for cursor in cursors:
        console.print(f"  {orjson.dumps(cursor).decode()}")

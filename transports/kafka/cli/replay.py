"""``tokcap replay``: rebuild a store from a run's log into an empty directory.

A whole replay runs the real ``Materializer`` until it has applied everything the log held when the replay
began, so the directory ends byte for byte like every other projection of the run, checkpoints included,
and a materializer can continue from it.
A partial replay (``--rollout`` or ``--until``) applies the chosen events through ``LogApplier`` with the same
apply step; it writes no checkpoint, so it is a view for debugging, not a base for a materializer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from tokcap.cli.progress import make_progress
from tokcap.delta_records import lineage_report
from tokcap.errors import InvalidInputError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.rollout_ids import validate_rollout_id
from transports.kafka.cli.options import parse_key_values, parse_offsets, resolve_run_topic
from transports.kafka.client.admin import probe_broker, watermarks
from transports.kafka.materializer.loop import Materializer
from transports.kafka.timeline import LogApplier, read_log

__all__ = ["prepare_replay_directory", "render_replay", "run_replay"]

_POLL_S = 0.1


def prepare_replay_directory(directory: Path, force: bool) -> None:
    """Create the directory, or accept an empty one; one with files only with ``--force``."""
    if directory.exists() and not directory.is_dir():
        raise InvalidInputError(f"--dir {directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        raise InvalidInputError(
            f"--dir {directory} is not empty; replay into a new directory, or pass --force to apply on top of it"
        )
    directory.mkdir(parents=True, exist_ok=True)


def run_replay(
    bootstrap: str,
    directory: Path,
    *,
    run_id: str | None,
    topic: str | None,
    rollout_id: str | None,
    until: str,
    force: bool,
    client_options: Sequence[str],
    timeout_s: float,
    show_progress: bool,
) -> dict[str, Any]:
    """Replay the run into ``directory``; return what was applied."""
    name = resolve_run_topic(run_id, topic)
    offsets = parse_offsets(until)
    if rollout_id is not None:
        rollout_id = validate_rollout_id(rollout_id)
    client_config = parse_key_values(client_options, "-X")
    probe_broker(bootstrap, client_config=client_config, timeout_s=timeout_s)
    marks = watermarks(bootstrap, name, client_config=client_config, timeout_s=timeout_s)
    prepare_replay_directory(directory, force)
    started = time.perf_counter()
    if rollout_id is None and offsets is None:
        applied = _replay_whole(bootstrap, name, directory, marks, client_config, show_progress)
        mode = "materializer"
    else:
        applied = _replay_part(
            bootstrap, name, directory, rollout_id, offsets, marks, client_config, timeout_s, show_progress
        )
        mode = "partial"
    store = TokenCaptureStore(directory)
    lineage = _lineage_of(store)
    return {
        "topic": name,
        "store_dir": str(directory),
        "mode": mode,
        "rollout_id": rollout_id,
        "until": None if offsets is None else {str(p): o for p, o in sorted(offsets.items())},
        "end_offsets": {str(p): high for p, (_, high) in marks.items()},
        "messages_applied": applied,
        "rollouts": len(store.rollout_ids()),
        "seconds": time.perf_counter() - started,
        "lineage": lineage,
    }


def _lineage_of(store: TokenCaptureStore) -> dict[str, Any]:
    """Delta records in the replayed store, and per rollout the calls whose full prompts are not proven."""
    delta_records = 0
    unproven: dict[str, list[str]] = {}
    for rollout_id in store.rollout_ids():
        if store.read_state(rollout_id).retired:
            continue
        report = lineage_report(store.read_entries(rollout_id))
        delta_records += report.delta_records
        if not report.sound:
            unproven[rollout_id] = [*report.unrebuildable, *report.digest_mismatches]
    return {"delta_records": delta_records, "unproven_calls": unproven}


def _replay_whole(
    bootstrap: str,
    topic: str,
    directory: Path,
    marks: dict[int, tuple[int, int]],
    client_config: dict[str, Any],
    show_progress: bool,
) -> int:
    """Run a materializer until it applied every offset the log held at the start, then stop it cleanly."""
    total = sum(high for _, high in marks.values())
    materializer = Materializer(bootstrap, topic, directory, consumer_config=client_config)
    with make_progress(show_progress) as progress:
        task = progress.add_task("replaying", total=total)
        materializer.start()
        try:
            while True:
                applied = materializer.applied_offsets()
                progress.update(
                    task, completed=sum(min(applied.get(p, 0), high) for p, (_, high) in marks.items())
                )
                if all(applied.get(p, 0) >= high for p, (_, high) in marks.items()):
                    break
                # wait_for raises MaterializerFailedError if the materializer thread died.
                materializer.wait_for(0, -1, 0)
                time.sleep(_POLL_S)
        finally:
            materializer.stop()
    return total


def _replay_part(
    bootstrap: str,
    topic: str,
    directory: Path,
    rollout_id: str | None,
    offsets: dict[int, int] | None,
    marks: dict[int, tuple[int, int]],
    client_config: dict[str, Any],
    timeout_s: float,
    show_progress: bool,
) -> int:
    """Apply the chosen rollout's events, up to the chosen offsets, through the store's apply step."""
    total = sum(min(high, (offsets or {}).get(p, high)) for p, (_, high) in marks.items())
    store = TokenCaptureStore(directory)
    applier = LogApplier.over_log(store, topic, bootstrap, client_config=client_config, timeout_s=timeout_s)
    applied = 0
    with contextlib.closing(applier), make_progress(show_progress) as progress:
        task = progress.add_task("replaying", total=total)
        for message in read_log(
            bootstrap,
            topic,
            key=None if rollout_id is None else rollout_id.encode(),
            until=offsets,
            client_config=client_config,
            timeout_s=timeout_s,
            on_message=lambda partition, offset: progress.advance(task),
            on_skipped=applier.pass_over,
        ):
            applier.take(message)
            applied += 1
    if rollout_id is not None and applied == 0:
        raise InvalidInputError(
            f"rollout {rollout_id!r} has no events in topic {topic!r} before the chosen offsets"
        )
    if applier.unfinished_groups() and offsets is not None:
        raise InvalidInputError(
            f"--until cuts large events in two (chunk groups {applier.unfinished_groups()} are unfinished); "
            "choose offsets after their last chunks"
        )
    return applied


def render_replay(summary: dict[str, Any], console: Console) -> None:
    """One paragraph: what was replayed, from where, into where."""
    scope = f"rollout {summary['rollout_id']}" if summary["rollout_id"] else "every rollout"
    until = (
        "the end of the log"
        if summary["until"] is None
        else ", ".join(f"p{p} < {o}" for p, o in summary["until"].items())
    )
    console.print(
        f"replayed {scope} of {summary['topic']} up to {until}: {summary['messages_applied']} messages, "
        f"{summary['rollouts']} rollouts in {summary['store_dir']} ({summary['seconds']:.2f} s, {summary['mode']})"
    )
    lineage = summary.get("lineage") or {}
    for rollout_id, calls in sorted(lineage.get("unproven_calls", {}).items()):
        console.print(
            f"warning: rollout {rollout_id}: calls {', '.join(calls)} have prompts that cannot be rebuilt "
            "and verified from their parents; consumers will mask them"
        )
    if summary["mode"] == "partial":
        console.print(
            "note: a partial replay writes no checkpoint; do not point a materializer at this directory"
        )

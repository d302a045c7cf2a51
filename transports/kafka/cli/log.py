"""``tokcap log``: one rollout's events in log order, and what the apply step decided for each.

The partition is read from the start; the rollout's events are applied to a scratch store with the real
apply step at their log positions, so each verdict is the one every materializer of the run took.
The scratch store is deleted afterwards; nothing the run uses is touched.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from tokcap.delta_records import lineage_report
from tokcap.errors import InvalidInputError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.rollout_ids import validate_rollout_id
from transports.kafka.cli.options import parse_key_values, resolve_run_topic
from transports.kafka.client.admin import probe_broker
from transports.kafka.timeline import LogApplier, read_log

__all__ = ["format_timestamp", "render_lineage", "render_timeline", "rollout_timeline"]


def rollout_timeline(
    bootstrap: str,
    rollout_id: str,
    *,
    run_id: str | None,
    topic: str | None,
    client_options: Sequence[str],
    timeout_s: float,
) -> dict[str, Any]:
    """Every event of the rollout with its position, time, type, call, writer, size and verdict."""
    name = resolve_run_topic(run_id, topic)
    rollout_id = validate_rollout_id(rollout_id)
    client_config = parse_key_values(client_options, "-X")
    probe_broker(bootstrap, client_config=client_config, timeout_s=timeout_s)
    with tempfile.TemporaryDirectory(prefix="tokcap-log-") as scratch:
        applier = LogApplier.over_log(
            TokenCaptureStore(scratch), name, bootstrap, client_config=client_config, timeout_s=timeout_s
        )
        with contextlib.closing(applier):
            entries: list[dict[str, Any]] = []
            # Other rollouts' messages can abandon this rollout's open chunk groups, as they do in the materializer.
            for message in read_log(
                bootstrap,
                name,
                key=rollout_id.encode(),
                client_config=client_config,
                timeout_s=timeout_s,
                on_skipped=lambda skipped: entries.extend(e.to_dict() for e in applier.pass_over(skipped)),
            ):
                entries.extend(entry.to_dict() for entry in applier.take_all(message))
            state = applier.store.read_state(rollout_id) if entries else None
            # The applied records, checked as the builder checks them: delta prompts rebuilt, digests verified.
            readable = state is not None and not state.retired
            lineage = lineage_report(applier.store.read_entries(rollout_id)) if readable else None
            unfinished = applier.unfinished_groups()
    if not entries:
        raise InvalidInputError(
            f"rollout {rollout_id!r} has no events in topic {name!r}; check the rollout id and run"
        )
    return {
        "topic": name,
        "rollout_id": rollout_id,
        "events": entries,
        "final_state": None if state is None else state.lifecycle.value,
        "final_version": None if state is None else state.version,
        "incomplete": None if state is None else state.incomplete,
        "unfinished_chunk_groups": unfinished,
        "lineage": None if lineage is None else lineage.to_dict(),
    }


def format_timestamp(timestamp_ms: int | None) -> str:
    """Broker time of a message as UTC with milliseconds; ``-`` when the message has none."""
    if timestamp_ms is None:
        return "-"
    return datetime.fromtimestamp(timestamp_ms / 1000, tz=UTC).strftime("%H:%M:%S.%f")[:-3]


_DECISION_STYLES = {
    "accepted": "green",
    "no-op": "dim",
    "already-applied": "dim",
    "buffered": "dim",
    "rejected-after-freeze": "bold red",
    "rejected-retired": "bold red",
    "conflict": "bold red",
    "dead-lettered": "bold red",
}


def render_lineage(lineage: dict[str, Any] | None, console: Console) -> None:
    """One line on delta records, and a warning naming every call whose full prompt is not proven."""
    if lineage is None:
        return
    console.print(f"delta records: {lineage['delta_records']}")
    for call_id in lineage["unrebuildable"]:
        console.print(f"warning: call {call_id} stores a delta prompt that cannot be rebuilt and verified")
    for call_id in lineage["digest_mismatches"]:
        console.print(f"warning: call {call_id}'s tokens do not match its stored digest")


def render_timeline(timeline: dict[str, Any], console: Console) -> None:
    """One row per event, then the state the rollout ended in."""
    table = Table(title=f"{timeline['rollout_id']} in {timeline['topic']}", title_justify="left")
    for column in (
        "partition",
        "offset",
        "time (UTC)",
        "type",
        "call",
        "writer",
        "bytes",
        "decision",
        "detail",
    ):
        table.add_column(column, justify="right" if column in {"partition", "offset", "bytes"} else "left")
    for event in timeline["events"]:
        style = _DECISION_STYLES.get(event["decision"], "")
        decision = f"[{style}]{event['decision']}[/{style}]" if style else event["decision"]
        detail = event["detail"]
        if event["snapshot_id"] and event["event_type"] == "freeze":
            detail = f"snapshot {event['snapshot_id']} v{event['version']}" + (
                f"; {detail}" if detail else ""
            )
        elif event["version"] is not None and event["decision"] == "rejected-after-freeze":
            detail = f"{detail}; version now {event['version']}"
        table.add_row(
            str(event["partition"]),
            str(event["offset"]),
            format_timestamp(event["timestamp_ms"]),
            event["event_type"],
            event["model_call_id"],
            event["writer"],
            str(event["size"]),
            decision,
            detail,
        )
    console.print(table)
    console.print(
        f"final state: {timeline['final_state']}, version {timeline['final_version']}, "
        f"incomplete {'yes' if timeline['incomplete'] else 'no'}"
    )
    for group in timeline["unfinished_chunk_groups"]:
        console.print(f"warning: chunk group {group} never completed in the log")
    render_lineage(timeline.get("lineage"), console)

"""What ``tokcap inspect`` shows of the files a Kafka materializer leaves beside a store's rollouts.

Checkpoints, partition owner records and dead-letter logs are named by the modules that write them; reading
them needs no Kafka client, so a store directory copied off a materializer node can be inspected anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from tokcap.errors import StoreCorruptionError
from transports.kafka.materializer.checkpoint import checkpoint_files
from transports.kafka.materializer.dead_letters import dead_letter_files
from transports.kafka.materializer.ownership import owner_record_files

__all__ = ["describe_side_files", "render_side_files"]


def describe_side_files(directory: Path) -> dict[str, Any]:
    """The checkpoints, owner records and dead letters in ``directory``, by file name."""
    return {
        "kafka_checkpoints": {path.name: _json_file(path) for path in checkpoint_files(directory)},
        "kafka_owners": {path.name: _json_file(path) for path in owner_record_files(directory)},
        "dead_letters": {path.name: _json_lines(path) for path in dead_letter_files(directory)},
    }


def render_side_files(description: Mapping[str, Any], console: Console) -> None:
    """One line per checkpoint, owner record and dead-letter log, under the table of rollouts."""
    for name, checkpoint in description["kafka_checkpoints"].items():
        bound = f" (id {checkpoint['topic_id']})" if checkpoint.get("topic_id") else ""
        console.print(f"{name}: topic {checkpoint['topic']}{bound} next offset {checkpoint['next_offset']}")
    for name, owner in description.get("kafka_owners", {}).items():
        bound = f" (id {owner['topic_id']})" if owner.get("topic_id") else ""
        console.print(f"{name}: owns partition {owner.get('partition')} of topic {owner.get('topic')}{bound}")
    for name, lines in description["dead_letters"].items():
        console.print(f"{name}: {len(lines)} dead-lettered messages")


def _json_file(path: Path) -> dict[str, Any]:
    """A side file's JSON object; a damaged one is named, so inspecting never hides which file it was."""
    try:
        value = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise StoreCorruptionError(f"{path} is not valid JSON ({exc}): the side file is damaged") from exc
    if not isinstance(value, dict):
        raise StoreCorruptionError(f"{path} holds {type(value).__name__}, not a JSON object")
    return value


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The complete lines of an append-only side file; a torn last line is ignored as the store ignores it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    records: list[dict[str, Any]] = []
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return records

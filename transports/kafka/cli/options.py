"""Parsing what Kafka commands take on the command line: client settings, partitions and offsets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokcap.errors import InvalidInputError
from transports.kafka.client.topics import resolve_topic

__all__ = ["parse_key_values", "parse_offsets", "parse_partitions", "resolve_run_topic"]


def parse_key_values(items: Sequence[str], option: str) -> dict[str, Any]:
    """Turn ``KEY=VALUE`` strings into a dict; a value stays a string, as librdkafka expects."""
    settings: dict[str, Any] = {}
    for item in items:
        key, separator, value = item.partition("=")
        if not separator or not key.strip():
            raise InvalidInputError(f"{option} {item!r} must look like KEY=VALUE")
        settings[key.strip()] = value
    return settings


def parse_partitions(text: str | None) -> list[int] | None:
    """``"0,2"`` to ``[0, 2]`` and ``"0-3,6"`` to ``[0, 1, 2, 3, 6]``; ``None`` means every partition."""
    if text is None:
        return None
    partitions: set[int] = set()
    for part in (part.strip() for part in text.split(",")):
        if not part:
            continue
        first, dash, last = part.partition("-")
        try:
            low, high = (int(first), int(last)) if dash and first else (int(part), int(part))
        except ValueError:
            raise InvalidInputError(
                f"--partitions {text!r} must be comma-separated partition numbers or ranges (0-3,6)"
            ) from None
        if high < low:
            raise InvalidInputError(f"--partitions {text!r} has the range {part!r} running backwards")
        partitions.update(range(low, high + 1))
    if not partitions or min(partitions) < 0:
        raise InvalidInputError(f"--partitions {text!r} must name partitions 0 or above")
    return sorted(partitions)


def parse_offsets(text: str) -> dict[int, int] | None:
    """``"end"`` to ``None``; ``"0:120,1:98"`` to ``{0: 120, 1: 98}`` (apply offsets below these)."""
    if text.strip().lower() == "end":
        return None
    offsets: dict[int, int] = {}
    for part in text.split(","):
        partition, separator, offset = part.strip().partition(":")
        try:
            if not separator:
                raise ValueError(part)
            offsets[int(partition)] = int(offset)
        except ValueError:
            raise InvalidInputError(
                f"--until {text!r} must be 'end' or PARTITION:OFFSET[,PARTITION:OFFSET...], e.g. 0:120,1:98"
            ) from None
    if any(p < 0 or o < 0 for p, o in offsets.items()):
        raise InvalidInputError(f"--until {text!r} has a negative partition or offset")
    return offsets


def resolve_run_topic(run_id: str | None, topic: str | None) -> str:
    """The topic a command works on, from exactly one of ``--run`` or ``--topic``."""
    if (run_id is None) == (topic is None):
        raise InvalidInputError("pass exactly one of --run RUN (topic tokcap.RUN) or --topic TOPIC")
    return resolve_topic(run_id, topic)

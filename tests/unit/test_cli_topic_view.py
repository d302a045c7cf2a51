"""What ``tokcap topic describe`` tells an operator: partitions, durability settings and replay risk."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from transports.kafka.cli.topic import render_description

LOST_START_WARNING = "retention removed the start of the run; a full replay is no longer possible"


def _described(*, under_replicated: bool, replayable: bool) -> dict[str, Any]:
    return {
        "topic": "tokcap.exp-7",
        "messages": 42,
        "partitions": [
            {
                "partition": 0,
                "leader": 1,
                "replicas": [1, 2, 3],
                "in_sync_replicas": [1, 2] if under_replicated else [1, 2, 3],
                "under_replicated": under_replicated,
                "low_offset": 0 if replayable else 7,
                "high_offset": 42,
            }
        ],
        "configs": {"min.insync.replicas": "2", "retention.ms": None},
        "replayable_from_start": replayable,
        "warnings": [] if replayable else [LOST_START_WARNING],
    }


def _render(description: dict[str, Any]) -> str:
    out = io.StringIO()
    render_description(description, Console(file=out, width=120, color_system=None))
    return out.getvalue()


def test_a_healthy_topic_shows_its_partitions_and_settings_without_warnings() -> None:
    text = _render(_described(under_replicated=False, replayable=True))
    assert "tokcap.exp-7: 42 messages" in text
    assert "1,2,3" in text and "under-replicated" not in text
    assert "min.insync.replicas = 2" in text
    assert "retention.ms = (not reported)" in text
    assert "warning" not in text


def test_an_under_replicated_partition_and_a_lost_log_start_are_both_called_out() -> None:
    text = _render(_described(under_replicated=True, replayable=False))
    assert "1,2 (under-replicated)" in text
    assert "warning: retention removed the start of the run; a full replay is no longer possible" in text

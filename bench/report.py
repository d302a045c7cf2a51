"""Tables for the terminal and the README, the target check, and the JSON file."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

__all__ = ["Target", "evaluate_targets", "main_rows", "print_report", "write_json"]


@dataclass(frozen=True)
class Target:
    """One goal of the issue, checked against a figure of the main shape."""

    name: str
    figure: str
    goal: str
    met: Callable[[float], bool]


TARGETS = (
    Target("file store put/s ÷ fsync/s", "ratios.file_puts_vs_fsync", ">= 1.0", lambda v: v >= 1.0),
    Target("Kafka put/s ÷ file store put/s", "ratios.kafka_puts_vs_file_puts", ">= 1.0", lambda v: v >= 1.0),
    Target("Kafka freeze p99 under load", "kafka_freeze_p99_ms", "< 50 ms", lambda v: v < 50.0),
    Target("file store freeze p99 under load", "file_freeze_p99_ms", "< 10 ms", lambda v: v < 10.0),
    Target("wire bytes per token", "wire_bytes_per_token", "<= 12", lambda v: v <= 12.0),
    Target("replay entries/s ÷ orjson entries/s", "ratios.replay_vs_orjson", ">= 0.5", lambda v: v >= 0.5),
)


def _lookup(figures: dict[str, Any], name: str) -> float:
    value: Any = figures
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return math.nan
        value = value[part]
    return float(value)


def _fmt(value: float, digits: int = 0) -> str:
    if math.isnan(value):
        return "—"
    if math.isinf(value):
        return "∞"
    return f"{value:,.{digits}f}"


def evaluate_targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with the measured value and whether it is met (``None`` when not measured)."""
    checked = []
    for target in TARGETS:
        value = _lookup(figures, target.figure)
        checked.append(
            {
                "target": target.name,
                "goal": target.goal,
                "value": None if math.isnan(value) else value,
                "met": None if math.isnan(value) else target.met(value),
            }
        )
    return checked


def main_rows(figures: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows of the side-by-side table: figure, file store, Kafka, physical reference."""
    f = figures

    def g(name: str, digits: int = 0) -> str:
        return _fmt(_lookup(f, name), digits)

    return [
        (
            "put calls/s (intents on)",
            g("file_puts_per_s"),
            g("kafka_puts_per_s"),
            f"fsync/s {g('fsync_per_s')}",
        ),
        (
            "intent+put calls/s",
            g("file_calls_per_s"),
            g("kafka_calls_per_s"),
            f"syncfs/s {g('syncfs_per_s')}",
        ),
        (
            "generated tokens/s",
            g("file_generated_tokens_per_s"),
            g("kafka_generated_tokens_per_s"),
            f"rename/s {g('rename_per_s')}",
        ),
        ("freeze p50 under load (ms)", g("file_freeze_p50_ms", 1), g("kafka_freeze_p50_ms", 1), ""),
        ("freeze p99 under load (ms)", g("file_freeze_p99_ms", 1), g("kafka_freeze_p99_ms", 1), ""),
        ("puts per filesystem sync", g("file_puts_per_sync", 1), "", ""),
        ("freeze alone, no load (ms)", g("file_freeze_unloaded_ms", 1), "", ""),
        (
            "CPU per intent / put / freeze (us)",
            f"{g('file_intent_cpu_us')} / {g('file_put_cpu_us')} / {g('file_freeze_cpu_us')}",
            "",
            f"one core: {g('file_cpu_bound_puts_per_s')} put/s",
        ),
        (
            "replay (entries/s)",
            "",
            g("replay_puts_per_s"),
            f"orjson encode+write {g('orjson_entries_per_s')}",
        ),
        (
            "live materializer backlog when the last put returned (events)",
            "",
            g("kafka_lag_at_end_of_puts"),
            "",
        ),
        ("with the materializer in its own process:", "", "", ""),
        ("  put calls/s", "", g("kafka_ext_puts_per_s"), ""),
        (
            "  freeze p50 / p99 under load (ms)",
            "",
            f"{g('kafka_ext_freeze_p50_ms', 1)} / {g('kafka_ext_freeze_p99_ms', 1)}",
            "",
        ),
        ("  backlog when the last put returned (events)", "", g("kafka_ext_lag_at_end_of_puts"), ""),
        ("replay (events/s)", "", g("replay_events_per_s"), ""),
        ("apply step alone (events/s)", "", g("apply_events_per_s"), ""),
        ("apply step alone (tokens/s)", "", g("apply_tokens_per_s"), ""),
        ("replay tokens/s", "", g("replay_tokens_per_s"), f"orjson {g('orjson_tokens_per_s')}"),
        ("replay of whole topic (s)", "", g("replay_seconds", 2), ""),
        (
            "wire bytes/token (before compression)",
            "",
            g("wire_bytes_per_token", 2),
            f"JSON events {g('json_event_bytes_per_token', 2)}",
        ),
        (
            "disk bytes/token",
            g("file_disk_bytes_per_token", 2),
            g("replay_disk_bytes_per_token", 2),
            f"entry lines {g('file_entry_bytes_per_token', 2)}",
        ),
    ]


GROWTH_COLUMNS = (
    ("shape", "shape.label", 0),
    ("file put/s", "figures.file_puts_per_s", 0),
    ("file gen tok/s", "figures.file_generated_tokens_per_s", 0),
    ("file freeze p99 ms", "figures.file_freeze_p99_ms", 1),
    ("Kafka put/s", "figures.kafka_puts_per_s", 0),
    ("Kafka gen tok/s", "figures.kafka_generated_tokens_per_s", 0),
    ("Kafka freeze p99 ms", "figures.kafka_freeze_p99_ms", 1),
    ("replay s", "figures.replay_seconds", 2),
    ("replay entries/s", "figures.replay_puts_per_s", 0),
    ("orjson entries/s", "figures.orjson_entries_per_s", 0),
    ("wire B/tok", "figures.wire_bytes_per_token", 2),
    ("wire/new tokens, wire deltas", "figures.wire_vs_new_tokens_wire_on", 2),
    ("disk B/tok", "figures.file_disk_bytes_per_token", 2),
)


def growth_rows(growth: list[dict[str, Any]]) -> list[list[str]]:
    """One row per growth shape."""
    rows = []
    for result in growth:
        row = []
        for _, name, digits in GROWTH_COLUMNS:
            if name == "shape.label":
                row.append(str(result["shape"]["label"]))
            else:
                row.append(_fmt(_lookup(result, name), digits))
        rows.append(row)
    return rows


def print_report(results: dict[str, Any], console: Console) -> None:
    """Print the main table, the targets and the growth table."""
    main = results["main"]
    shape = main["shape"]
    figures = main["figures"]
    title = (
        f"{shape['rollouts']} concurrent rollouts x {shape['rounds']} rounds, {shape['label']}, "
        f"{shape['generated_tokens']} generated + {shape['tool_tokens']} tool tokens/turn "
        f"(median of {results['options']['repeats']})"
    )
    table = Table(title=title)
    for column in ("figure", "file store", "Kafka (acks=all)", "physical reference"):
        table.add_column(column, justify="left" if column in ("figure", "physical reference") else "right")
    for row in main_rows(figures):
        table.add_row(*row)
    console.print(table)

    targets = Table(title="targets (ratios measured in this run)")
    for column in ("target", "goal", "measured", "met"):
        targets.add_column(column)
    for check in evaluate_targets(figures):
        value = check["value"]
        met = check["met"]
        targets.add_row(
            check["target"],
            check["goal"],
            "—" if value is None else f"{value:,.2f}",
            "—" if met is None else ("yes" if met else "NO"),
        )
    console.print(targets)

    if results["growth"]:
        growth = Table(title=f"growth ({results['options']['growth_rollouts']} concurrent rollouts)")
        for heading, _, _ in GROWTH_COLUMNS:
            growth.add_column(heading, justify="left" if heading == "shape" else "right")
        for growth_row in growth_rows(results["growth"]):
            growth.add_row(*growth_row)
        console.print(growth)


def write_json(results: dict[str, Any], path: Path) -> None:
    """Write the results with the target check beside them; NaN becomes null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(results)
    data["targets"] = evaluate_targets(results["main"]["figures"])
    path.write_bytes(
        orjson.dumps(_without_nan(data), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
    )


def _without_nan(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {key: _without_nan(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_without_nan(item) for item in value]
    return value

"""A run's results as tables (for the terminal and the README), with the targets checked, and as a JSON file."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from bench.harness import machine_line
from bench.scenarios import SCENARIOS, by_name
from bench.targets import evaluate
from bench.targets import lookup as _lookup

__all__ = ["main_rows", "print_report", "sections", "write_json"]


def _fmt(value: float, digits: int = 0) -> str:
    if math.isnan(value):
        return "—"
    if math.isinf(value):
        return "∞"
    return f"{value:,.{digits}f}"


def target_rows(checks: list[dict[str, Any]], no: str = "NO") -> list[list[str]]:
    """Rows of the target table: target, goal, anchor, measured, met."""
    return [
        [
            check["target"],
            check["goal"],
            check["anchor"] or "",
            "—" if check["value"] is None else f"{check['value']:,.2f}",
            "—" if check["met"] is None else ("yes" if check["met"] else no),
        ]
        for check in checks
    ]


MAIN_COLUMNS = ("figure", "Gym 0.7.0 file store", "file store", "Kafka (acks=all)", "physical reference")

_GYM_CELLS = {
    "put calls/s (intents on)": ("gym_puts_per_s", 0),
    "intent+put calls/s": ("gym_calls_per_s", 0),
    "generated tokens/s": ("gym_generated_tokens_per_s", 0),
    "freeze p50 under load (ms)": ("gym_freeze_p50_ms", 1),
    "freeze p99 under load (ms)": ("gym_freeze_p99_ms", 1),
}


def main_rows(figures: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Rows of the side-by-side table: figure, Gym's file store, file store, Kafka, physical reference."""
    rows = []
    for name, file_cell, kafka_cell, reference in _tokcap_rows(figures):
        gym = _GYM_CELLS.get(name)
        rows.append(
            (
                name,
                "" if gym is None else _fmt(_lookup(figures, gym[0]), gym[1]),
                file_cell,
                kafka_cell,
                reference,
            )
        )
        if name == "put calls/s (intents on)":
            rows.append(
                (
                    "  put/s ÷ Gym",
                    "1.00" if "gym_puts_per_s" in figures else "—",
                    _fmt(_lookup(figures, "ratios.file_puts_vs_gym"), 2),
                    _fmt(_lookup(figures, "ratios.kafka_puts_vs_gym"), 2),
                    "",
                )
            )
    return rows


def _tokcap_rows(figures: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    f = figures

    def g(name: str, digits: int = 0) -> str:
        return _fmt(_lookup(f, name), digits)

    def other_process(heading: str, prefix: str, when: str) -> list[tuple[str, str, str, str]]:
        """The Kafka load run once more with one side in a process of its own: its put/s and freezes."""
        freezes = f"{g(f'{prefix}_freeze_p50_ms', 1)} / {g(f'{prefix}_freeze_p99_ms', 1)}"
        return [
            (heading, "", "", ""),
            ("  put calls/s", "", g(f"{prefix}_puts_per_s"), ""),
            (f"  freeze p50 / p99 {when} (ms)", "", freezes, ""),
        ]

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
        (
            "freeze p50 under load (ms)",
            g("file_freeze_p50_ms", 1),
            g("kafka_freeze_p50_ms", 1),
            f"file create/s {g('create_per_s')}",
        ),
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
        ("  one worker process, timed from its start (entries/s)", "", g("replay_one_worker_puts_per_s"), ""),
        (
            "  one worker process per partition, the same way (entries/s)",
            "",
            g("replay_workers_puts_per_s"),
            "",
        ),
        (
            "live materializer backlog when the last put returned (events)",
            "",
            g("kafka_lag_at_end_of_puts"),
            "",
        ),
        *other_process("with the materializer in its own process:", "kafka_ext", "under load"),
        ("  backlog when the last put returned (events)", "", g("kafka_ext_lag_at_end_of_puts"), ""),
        *other_process(
            "with the trainer in its own process (source and materializer there, sinks here):",
            "kafka_split",
            "under load, as the trainer saw it",
        ),
        (
            "  freeze p99 round trip from the load's process (ms)",
            "",
            g("kafka_split_round_trip_p99_ms", 1),
            "",
        ),
        ("replay (events/s)", "", g("replay_events_per_s"), ""),
        ("apply step alone (events/s)", "", g("apply_events_per_s"), ""),
        ("apply step alone (tokens/s)", "", g("apply_tokens_per_s"), ""),
        ("apply step CPU per event (us)", "", g("apply_cpu_us_per_event"), ""),
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


BATCH_COLUMNS = (
    "store",
    "put/s",
    "put/s ÷ Gym",
    "freezes/s",
    "freezes/s ÷ Gym",
    "batch freeze ms",
    "events not applied when the freezes were sent",
    "freezes ahead of backlog",
    "freezes answered ahead",
    "freeze-phase CPU s",
)
_BATCH_NAMES = (("gym", "Gym 0.7.0 file store"), ("file", "tokcap file store"), ("kafka", "tokcap Kafka"))


def batch_rows(batch: dict[str, Any]) -> list[list[str]]:
    """One row per store of the batch freeze: put/s and freezes/s with their ratios to Gym."""
    rows = []
    for key, label in _BATCH_NAMES:
        figures = batch["targets"].get(key)
        if figures is None:
            continue
        rows.append(
            [
                label,
                _fmt(figures["puts_per_s"]),
                _fmt(figures["puts_vs_gym"], 2),
                _fmt(figures["freezes_per_s"]),
                _fmt(figures["freezes_vs_gym"], 2),
                _fmt(figures["batch_freeze_ms"]),
                *(
                    _fmt(float(figures[name]), digits) if name in figures else ""
                    for name, digits in (
                        ("lag_when_freezes_sent", 0),
                        ("commands_ahead", 0),
                        ("freezes_answered_ahead", 0),
                        ("freeze_phase_cpu_s", 2),
                    )
                ),
            ]
        )
    return rows


WORKERS_COLUMNS = ("workers", "events/s total", "events/s per worker", "CPU us/event", "total ÷ 1 worker")


def workers_rows(workers: dict[str, Any]) -> list[list[str]]:
    """One row per worker count: total and per-worker events/s, CPU per event, speed-up."""
    rows = []
    for n, figures in sorted(workers["figures"].items(), key=lambda item: int(item[0])):
        rows.append(
            [
                n,
                _fmt(figures["events_per_s"]),
                _fmt(figures["events_per_s_per_worker"]),
                _fmt(figures["cpu_s_per_event"] * 1e6),
                _fmt(figures["vs_first"], 2),
            ]
        )
    return rows


GROWTH_COLUMNS = (
    ("shape", "shape.label", 0),
    ("wire B/call off", "figures.wire_bytes_per_call_wire_off", 0),
    ("wire B/call on", "figures.wire_bytes_per_call_wire_on", 0),
    ("wire ÷ new packed, off", "figures.wire_vs_new_tokens_wire_off", 2),
    ("wire ÷ new packed, on", "figures.wire_vs_new_tokens_wire_on", 2),
    ("store B/call full", "figures.store_bytes_per_call_records_off", 0),
    ("store B/call delta", "figures.store_bytes_per_call_records_on", 0),
    ("store ÷ new JSON, full", "figures.store_vs_new_tokens_json_records_off", 2),
    ("store ÷ new JSON, delta", "figures.store_vs_new_tokens_json_records_on", 2),
    ("file put/s full", "figures.file_puts_per_s", 0),
    ("file put/s delta", "figures.file_puts_per_s_records_on", 0),
    ("Kafka put/s off", "figures.kafka_puts_per_s_wire_off", 0),
    ("Kafka put/s on", "figures.kafka_puts_per_s_wire_on", 0),
    ("Kafka freeze p99 ms off", "figures.kafka_freeze_p99_ms_wire_off", 1),
    ("Kafka freeze p99 ms on", "figures.kafka_freeze_p99_ms_wire_on", 1),
    ("replay entries/s off", "figures.replay_entries_per_s_wire_off", 0),
    ("replay entries/s on", "figures.replay_entries_per_s_wire_on", 0),
    ("Kafka put/s delta", "figures.kafka_puts_per_s_records_on", 0),
    ("Kafka freeze p99 ms delta", "figures.kafka_freeze_p99_ms_records_on", 1),
    ("replay entries/s delta", "figures.replay_entries_per_s_records_on", 0),
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


RESOLVE_COLUMNS = ("lineage resolver", "resolves per run", "p50 ms", "p99 ms", "max ms")


def resolve_rows(resolve: dict[str, Any]) -> list[list[str]]:
    """The resolvers' latency rows: Kafka probed from a process of its own, then each closed loop in the load's."""
    f = resolve["figures"]
    rows = []
    for label, prefix, count in (
        ("model-server process of its own, main load running", "probe", "probe_resolves"),
        ("file store: the main shape's rollouts, resolve then put, in one process", "file", "resolves"),
        ("Kafka: the main shape's rollouts, resolve then put, in one process", "kafka", "resolves"),
    ):
        if f"{prefix}_p99_ms" in f:
            rows.append(
                [
                    label,
                    _fmt(f[count]),
                    *(_fmt(f[f"{prefix}_{name}_ms"], 2) for name in ("p50", "p99", "max")),
                ]
            )
    return rows


def long_rollout_rows(resolve_long: dict[str, Any]) -> list[list[str]]:
    """Per size, each resolver's warm-resolve p50 and p99 and each builder's median, with their ratio to Gym's."""
    rows = []
    for size, figures in resolve_long["sizes"].items():
        for name, f in figures["resolve"].items():
            rows.append(
                [size, f"resolve: {name}", _fmt(f["p50_ms"], 2), _fmt(f["p99_ms"], 2), _fmt(f["vs_gym"], 2)]
            )
        for name, f in figures["build"].items():
            rows.append([size, f"build: {name}", _fmt(f["median_ms"], 1), "", _fmt(f["vs_gym"], 2)])
    return rows


def intents_rows(intents: dict[str, Any]) -> list[list[str]]:
    """Per size, seconds and ms per 1,000 pairs, projected and durable."""
    return [
        [
            pairs,
            _fmt(f["projected"]["seconds"], 3),
            _fmt(f["projected"]["ms_per_1k"], 1),
            _fmt(f["durable"]["seconds"], 3),
            _fmt(f["durable"]["ms_per_1k"], 1),
        ]
        for pairs, f in intents["sizes"].items()
    ]


STAGING_COLUMNS = (
    "shape",
    "writer",
    "calls/s",
    "MB/s",
    "p50 ms",
    "p99 ms",
    "CPU ms/call",
    "MB/s ÷ its floor",
    "ledger record p50 / p99 ms",
    "ledger floor p50 / p99 ms",
)


def staging_rows(staging: dict[str, Any]) -> list[list[str]]:
    """One row per shape and writer; Kafka writers are read against the Kafka floor, the others the file floor."""
    rows = []
    for shape in ("moe", "image"):
        writers: dict[str, dict[str, float]] = staging["figures"].get(shape, {})
        for writer, f in writers.items():
            floor = writers.get("kafka_floor" if writer.startswith("kafka") else "floor", {})
            rows.append(
                [
                    shape,
                    writer,
                    _fmt(f["calls_per_s"]),
                    _fmt(f["mb_per_s"]),
                    _fmt(f["p50_ms"], 1),
                    _fmt(f["p99_ms"], 1),
                    _fmt(f["cpu_ms_per_call"], 2),
                    _fmt(f["mb_per_s"] / floor["mb_per_s"], 2) if floor.get("mb_per_s") else "—",
                    *(
                        f"{_fmt(f[f'{n}_p50_ms'], 1)} / {_fmt(f[f'{n}_p99_ms'], 1)}"
                        if f"{n}_p99_ms" in f
                        else ""
                        for n in ("ledger", "ledger_floor")
                    ),
                ]
            )
    return rows


def trial_rows(figures: tuple[str, ...], measured: dict[str, Any], anchor: str | None) -> list[list[str]]:
    """One row per figure: each variant's median, then each other variant's ratio to the anchor."""
    medians = measured["medians"]
    ratios = {name: values for name, values in measured["ratios"].items() if name != anchor}
    return [
        [
            figure,
            *(_fmt(values.get(figure, math.nan), 2) for values in medians.values()),
            *(_fmt(values.get(figure, math.nan), 2) for values in ratios.values()),
        ]
        for figure in figures
    ]


_TABLES_OF_DATA: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], list[list[str]]]]] = {
    "resolve": (RESOLVE_COLUMNS, resolve_rows),
    "resolve_long": (("calls", "what", "p50 / median ms", "p99 ms", "÷ Gym"), long_rollout_rows),
    "intents": (("pairs", "projected s", "projected ms / 1k", "durable s", "durable ms / 1k"), intents_rows),
}
"""Tables whose title is their scenario's load as ``bench.scenarios`` states it."""


def sections(results: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every table of a run as (title, headings, rows), in the order the README shows them."""
    options = results["options"]
    repeats = options["repeats"]
    tables: list[tuple[str, list[str], list[list[str]]]] = []
    main = results.get("main")
    if main is not None:
        shape = main["shape"]
        tables.append(
            (
                f"Main load (`python -m bench --only main`): {shape['rollouts']} concurrent rollouts x "
                f"{shape['rounds']} rounds, {shape['label']}, {shape['generated_tokens']} generated + "
                f"{shape['tool_tokens']} tool tokens per turn, intent + put per turn, freeze when a rollout "
                f"ends; median of {repeats}",
                list(MAIN_COLUMNS),
                [list(row) for row in main_rows(main["figures"])],
            )
        )
    batch = results.get("batch")
    if batch is not None:
        b = batch["shape"]
        tables.append(
            (
                f"Batch freeze (`python -m bench --only batch`): {b['rollouts']} rollouts x {b['turns']} turns, "
                f"{b['concurrency']} at a time, then all frozen at once; stores alternating, median of "
                f"{batch['repeats']}",
                list(BATCH_COLUMNS),
                batch_rows(batch),
            )
        )
    workers = results.get("workers")
    if workers is not None:
        tables.append(
            (
                f"Materializer workers (`python -m bench --only workers`): a topic of {workers['rollouts']} "
                f"rollouts x {workers['turns']} turns over {workers['partitions']} partitions applied from "
                f"offset 0; worker counts alternating, median of {workers['trials']}",
                list(WORKERS_COLUMNS),
                workers_rows(workers),
            )
        )
    if results.get("growth"):
        shapes = results["growth"]["shapes"]
        rounds = main["shape"]["rounds"] if main is not None else options["shape"]["rounds"]
        tables.append(
            (
                f"Growth grid (`python -m bench --only growth`): {options['growth_rollouts']} concurrent "
                f"rollouts x {rounds} rounds per shape; wire deltas (Kafka) and delta records (store) off and "
                f"on; timed figures median of {repeats}",
                [heading for heading, _, _ in GROWTH_COLUMNS],
                growth_rows(shapes),
            )
        )
    for name, (headings, rows) in _TABLES_OF_DATA.items():
        if results.get(name) is not None:
            scenario = by_name(name)
            title = f"{scenario.load} (`python -m bench --only {name}`); median of {repeats}"
            tables.append((title[0].upper() + title[1:], list(headings), rows(results[name])))
    staging = results.get("staging")
    if staging is not None:
        tables.append(
            (
                "Engine-side staging (`python -m bench --only staging`): "
                f"{options['staging_calls']} MoE calls and {options['staging_images']} image calls from "
                f"{options['staging_threads']} threads; writers taking turns, median of {repeats}; "
                f"64-call chain fetch p99 {_fmt(_lookup(staging, 'figures.chain_fetch_p99_ms'), 1)} ms",
                list(STAGING_COLUMNS),
                staging_rows(staging),
            )
        )
    for scenario in SCENARIOS:
        measured = results.get(scenario.name)
        if measured is None or "medians" not in measured:
            continue
        tables.append(
            (
                f"{scenario.name} (`python -m bench --only {scenario.name}`): {scenario.load}; "
                f"{'each trial in a fresh process, ' if scenario.trial else ''}variants taking turns, "
                f"median of {repeats}",
                [
                    "figure",
                    *measured["medians"],
                    *(f"{n} ÷ {scenario.anchor}" for n in measured["ratios"] if n != scenario.anchor),
                ],
                trial_rows(scenario.shown, measured, scenario.anchor),
            )
        )
    checks = evaluate(results)
    if checks:
        tables.append(
            (
                "Targets (measured in this run)",
                ["target", "goal", "anchor", "measured", "met"],
                target_rows(checks),
            )
        )
    return tables


def print_report(results: dict[str, Any], console: Console) -> None:
    """Print the machine line and every table of the run."""
    console.print(f"{results.get('command', 'python -m bench')} on {machine_line(results['machine'])}")
    for title, headings, rows in sections(results):
        table = Table(title=title)
        for index, heading in enumerate(headings):
            table.add_column(heading, justify="left" if index == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def write_json(results: dict[str, Any], path: Path) -> None:
    """Write the results with the target check beside them; NaN becomes null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(results)
    data["targets"] = evaluate(results)
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

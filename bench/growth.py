"""The growth grid with deltas on and off: does a call cost its new tokens, or the whole conversation?

For every shape of the grid (turns x prompt size, ``BenchOptions.growth_shapes``):

- **wire**: the put messages the sink would send (``sent_calls.encode_put``, the sink's own decision),
  with wire deltas off and on, per call, against the packed size of the call's new tokens alone
  (4 B per new token id, prompt suffix and generation, and 8 B per log prob);
- **store disk**: the entry file bytes per call of a file store written with the entries, full or as
  Gym-style delta records (``delta_records``: ``prompt_is_delta`` entries carrying only the suffix after
  their parent, stamped with ``stamp_lineage``), against the JSON of the call's new tokens alone;
- **Kafka** (with a broker): put/s, freeze p99 under load and replay entries/s of a full trial
  (``kafka_trial``) with wire deltas off and on; file store put/s beside them.

A call's new tokens: the prompt after its parent's prompt and generation (the whole prompt for the first
call), plus what it generated.

Run ``python -m bench.growth [--bootstrap HOST:PORT | --local-broker] [--rollouts N] [--turns 4,16,64]
[--prompts 1000,32000]``; figures go to ``bench/results/growth.json`` and a table to the terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from bench.broker import local_broker
from bench.file_store_trial import directory_bytes, run_file_store_trial
from bench.kafka_trial import run_kafka_trial, warm_up_broker
from bench.load import PreparedWorkload, prepare
from bench.options import BenchOptions
from bench.stats import median, percentile
from tokcap.delta_records import store_as_delta
from tokcap.events import PutEvent
from tokcap.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from tokcap.store import TokenCaptureStore
from transports.kafka.sent_calls import SentCalls, encode_put

__all__ = [
    "as_delta_records",
    "as_delta_workload",
    "main",
    "measure_growth",
    "new_tokens",
    "store_sizes",
    "wire_sizes",
]


def new_tokens(entries: Sequence[TokenEntry]) -> list[tuple[list[int], int]]:
    """Per entry of one rollout, in turn order: its new prompt ids and its generated token count."""
    result = []
    previous: list[int] = []
    for entry in entries:
        prompt = entry.prompt_token_ids
        shared = len(previous) if prompt[: len(previous)] == previous else 0
        result.append((prompt[shared:], len(entry.generation_token_ids)))
        previous = [*prompt, *entry.generation_token_ids]
    return result


def _rollouts(workload: PreparedWorkload) -> list[tuple[str, list[TokenEntry]]]:
    return [rollout for slot in workload.slots for rollout in slot]


def wire_sizes(workload: PreparedWorkload, *, wire_deltas: bool) -> dict[str, float]:
    """Message value bytes per call as the sink encodes the puts, and their ratio to the new tokens packed."""
    sent = SentCalls() if wire_deltas else None
    offset = 0
    wire = packed_new = calls = 0
    for rollout_id, entries in _rollouts(workload):
        for entry, (suffix, generated) in zip(entries, new_tokens(entries), strict=True):
            event = PutEvent(rollout_id=rollout_id, writer="bench-writer", entry=entry)
            messages = encode_put(event, sent, next_chunk_group=lambda: "bench:0")
            wire += sum(len(m.value) for m in messages)
            if sent is not None and len(messages) == 1:
                sent.remember(entry, 0, offset)
            offset += len(messages)
            packed_new += 4 * (len(suffix) + generated) + 8 * generated
            calls += 1
    return {"wire_bytes_per_call": wire / calls, "wire_vs_new_tokens": wire / packed_new}


def as_delta_records(entries: Sequence[TokenEntry]) -> list[TokenEntry]:
    """The entries as the capture path stores them with ``CaptureContext(delta_records=True)``.

    Each continuation whose prompt extends its parent's prompt and generation is cut by the capture path's
    own ``store_as_delta`` and stamped RESOLVED with the full sequence's digest; anything else stays a full
    ROOT record, as a call without a proven parent would.
    """
    records = []
    parent: TokenEntry | None = None
    for entry in entries:
        # Shallow: the cut and the stamp assign fields, never change the shared token lists in place.
        record = entry.model_copy()
        cumulative = None
        if parent is not None:
            cumulative = store_as_delta(record, [*parent.prompt_token_ids, *parent.generation_token_ids])
        if cumulative is None or parent is None:
            stamp_lineage(record, None, parent_resolution=ParentResolutionStatus.ROOT)
        else:
            stamp_lineage(
                record,
                parent.model_call_id,
                parent_resolution=ParentResolutionStatus.RESOLVED,
                cumulative=cumulative,
            )
        records.append(record)
        parent = entry
    return records


def as_delta_workload(workload: PreparedWorkload) -> PreparedWorkload:
    """The same workload with every rollout's entries as delta records (the file store's "delta on" load)."""
    slots = [
        [(rollout_id, as_delta_records(entries)) for rollout_id, entries in slot] for slot in workload.slots
    ]
    return replace(workload, slots=slots)


def store_sizes(workload: PreparedWorkload, directory: Path, *, delta_records: bool) -> dict[str, float]:
    """Entry file bytes per call of a file store holding the workload, and their ratio to the new tokens' JSON.

    ``delta_records`` stores the records the capture path's ``delta_records`` switch hands the store
    (``as_delta_records``).
    """
    store = TokenCaptureStore(directory)
    json_new = calls = 0

    async def write() -> None:
        nonlocal json_new, calls
        try:
            for _, entries in _rollouts(workload):
                records = as_delta_records(entries) if delta_records else list(entries)
                for record, (suffix, _) in zip(records, new_tokens(entries), strict=True):
                    await store.put(record)
                    json_new += len(orjson.dumps(suffix)) + len(orjson.dumps(record.generation_token_ids))
                    json_new += len(orjson.dumps(record.generation_log_probs))
                    calls += 1
        finally:
            await store.close()

    asyncio.run(write())
    disk = directory_bytes(directory, "*.tokens.jsonl")
    return {"store_bytes_per_call": disk / calls, "store_vs_new_tokens_json": disk / json_new}


async def _trials(
    workload: PreparedWorkload, delta_workload: PreparedWorkload, bootstrap: str | None, work_dir: Path
) -> dict[str, float]:
    figures: dict[str, float] = {}
    file_trial = await run_file_store_trial(workload, _fresh(work_dir / "file"))
    figures["file_puts_per_s"] = file_trial.load.puts_per_s
    figures["file_freeze_p99_ms"] = percentile(file_trial.load.freeze_under_load_ms, 0.99)
    delta_trial = await run_file_store_trial(delta_workload, _fresh(work_dir / "file-delta"))
    figures["file_puts_per_s_records_on"] = delta_trial.load.puts_per_s
    figures["file_freeze_p99_ms_records_on"] = percentile(delta_trial.load.freeze_under_load_ms, 0.99)
    if bootstrap is None:
        return figures
    for name, deltas in (("off", False), ("on", True)):
        kafka = await run_kafka_trial(
            workload, bootstrap, _fresh(work_dir / f"kafka-{name}"), {"wire_deltas": deltas}
        )
        figures[f"kafka_puts_per_s_wire_{name}"] = kafka.load.puts_per_s
        figures[f"kafka_freeze_p99_ms_wire_{name}"] = percentile(kafka.load.freeze_under_load_ms, 0.99)
        figures[f"replay_entries_per_s_wire_{name}"] = kafka.replay.puts_per_s
    # Delta on end to end: Gym-style delta records through the Kafka sink (wire deltas on as well), so the
    # materializer stores suffixes and a freeze reads them.
    kafka = await run_kafka_trial(
        delta_workload, bootstrap, _fresh(work_dir / "kafka-records-on"), {"wire_deltas": True}
    )
    figures["kafka_puts_per_s_records_on"] = kafka.load.puts_per_s
    figures["kafka_freeze_p99_ms_records_on"] = percentile(kafka.load.freeze_under_load_ms, 0.99)
    figures["replay_entries_per_s_records_on"] = kafka.replay.puts_per_s
    return figures


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def measure_growth(
    options: BenchOptions,
    bootstrap: str | None,
    work_dir: Path,
    *,
    delta_records: bool = True,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Every figure of every growth shape; ``delta_records`` adds the store-disk column for delta records.

    Byte sizes are deterministic and measured once; the timed trials run ``repeats`` times per shape and
    each timed figure is the median.
    """
    results = []
    for shape in options.growth_shapes():
        print(f"growth: {shape.label()} ({shape.total_puts} puts)", file=sys.stderr, flush=True)
        workload = prepare(shape, "growth")
        figures: dict[str, float] = {}
        for name, deltas in (("off", False), ("on", True)):
            figures.update(
                {f"{k}_wire_{name}": v for k, v in wire_sizes(workload, wire_deltas=deltas).items()}
            )
        switches = (("off", False), ("on", True)) if delta_records else (("off", False),)
        for name, records in switches:
            sizes = store_sizes(workload, _fresh(work_dir / f"store-{name}"), delta_records=records)
            figures.update({f"{k}_records_{name}": v for k, v in sizes.items()})
        delta_workload = as_delta_workload(workload)
        runs: dict[str, list[float]] = {}
        for repeat in range(repeats):
            print(f"growth: {shape.label()} repeat {repeat + 1}/{repeats}", file=sys.stderr, flush=True)
            for key, value in asyncio.run(_trials(workload, delta_workload, bootstrap, work_dir)).items():
                runs.setdefault(key, []).append(value)
        figures.update({key: median(values) for key, values in runs.items()})
        results.append({"shape": shape.__dict__ | {"label": shape.label()}, "figures": figures, "runs": runs})
    return results


_COLUMNS = [
    ("wire B/call off", "wire_bytes_per_call_wire_off", 0),
    ("wire B/call on", "wire_bytes_per_call_wire_on", 0),
    ("wire/new on", "wire_vs_new_tokens_wire_on", 2),
    ("store/new full", "store_vs_new_tokens_json_records_off", 2),
    ("store/new delta", "store_vs_new_tokens_json_records_on", 2),
    ("file put/s", "file_puts_per_s", 0),
    ("file put/s delta", "file_puts_per_s_records_on", 0),
    ("kafka put/s off", "kafka_puts_per_s_wire_off", 0),
    ("kafka put/s on", "kafka_puts_per_s_wire_on", 0),
    ("freeze p99 off", "kafka_freeze_p99_ms_wire_off", 1),
    ("freeze p99 on", "kafka_freeze_p99_ms_wire_on", 1),
    ("replay e/s off", "replay_entries_per_s_wire_off", 0),
    ("replay e/s on", "replay_entries_per_s_wire_on", 0),
]


def table(results: list[dict[str, Any]]) -> str:
    """The figures as a Markdown table, one row per shape."""
    lines = ["| shape | " + " | ".join(h for h, _, _ in _COLUMNS) + " |", "|---" * (len(_COLUMNS) + 1) + "|"]
    for result in results:
        figures = result["figures"]
        cells = [f"{figures[key]:,.{digits}f}" if key in figures else "-" for _, key, digits in _COLUMNS]
        lines.append(f"| {result['shape']['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the grid and write ``--output``."""
    parser = argparse.ArgumentParser(prog="python -m bench.growth", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--bootstrap", help="a running broker; without it and --local-broker, no Kafka columns"
    )
    where.add_argument(
        "--local-broker", action="store_true", help="start a broker of its own (scripts/kafka-broker)"
    )
    parser.add_argument(
        "--rollouts", type=int, default=BenchOptions().growth_rollouts, help="concurrent rollouts"
    )
    parser.add_argument("--rounds", type=int, default=BenchOptions().shape.rounds, help="rollouts per slot")
    parser.add_argument("--turns", default="4,16,64", help="comma-separated turn counts")
    parser.add_argument("--prompts", default="1000,32000", help="comma-separated first-prompt sizes")
    parser.add_argument(
        "--no-delta-records", action="store_true", help="leave out the store-disk column for delta records"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed trials per shape; the median is reported"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/growth.json"))
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    base = BenchOptions()
    options = replace(
        base,
        shape=replace(base.shape, rounds=args.rounds),
        growth_rollouts=args.rollouts,
        growth_turns=tuple(int(t) for t in args.turns.split(",")),
        growth_prompts=tuple(int(p) for p in args.prompts.split(",")),
    )
    work_dir = Path(tempfile.mkdtemp(prefix="tokcap-growth-", dir=args.work_dir))
    try:
        if args.local_broker:
            with local_broker(work_dir / "broker") as bootstrap:
                asyncio.run(warm_up_broker(bootstrap))
                results = measure_growth(
                    options,
                    bootstrap,
                    work_dir,
                    delta_records=not args.no_delta_records,
                    repeats=args.repeats,
                )
        else:
            if args.bootstrap:
                asyncio.run(warm_up_broker(args.bootstrap))
            results = measure_growth(
                options,
                args.bootstrap,
                work_dir,
                delta_records=not args.no_delta_records,
                repeats=args.repeats,
            )
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"options": options.to_json(), "growth": results}, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

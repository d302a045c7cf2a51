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

Run by ``python -m bench --only growth``; the timed loads of each shape take turns (``bench.harness``).
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from bench.file_store_trial import directory_bytes, run_file_store_trial
from bench.harness import Variant, alternate
from bench.kafka_trial import run_kafka_trial
from bench.load import PreparedWorkload, prepare
from bench.options import BenchOptions
from bench.stats import percentile
from tokcap.delta_records import store_as_delta
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import PutEvent
from tokcap.log.records import ParentResolutionStatus, TokenEntry, stamp_lineage
from transports.kafka.write.sent_calls import SentCalls, encode_put

__all__ = [
    "as_delta_records",
    "as_delta_workload",
    "corner_figures",
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


def _variants(
    workload: PreparedWorkload, delta_workload: PreparedWorkload, bootstrap: str | None
) -> dict[str, Variant]:
    """The timed loads of one shape: the file store with full and delta records, Kafka with wire deltas off, on,
    and with delta records end to end (Gym-style delta records through the sink, so the materializer stores
    suffixes and a freeze reads them)."""

    def file_store(load: PreparedWorkload, suffix: str) -> Variant:
        async def trial(directory: Path) -> dict[str, float]:
            done = await run_file_store_trial(load, directory)
            return {
                f"file_puts_per_s{suffix}": done.load.puts_per_s,
                f"file_freeze_p99_ms{suffix}": percentile(done.load.freeze_under_load_ms, 0.99),
            }

        return trial

    def kafka(load: PreparedWorkload, deltas: bool, suffix: str) -> Variant:
        async def trial(directory: Path) -> dict[str, float]:
            assert bootstrap is not None
            done = await run_kafka_trial(load, bootstrap, directory, {"wire_deltas": deltas})
            return {
                f"kafka_puts_per_s_{suffix}": done.load.puts_per_s,
                f"kafka_freeze_p99_ms_{suffix}": percentile(done.load.freeze_under_load_ms, 0.99),
                f"replay_entries_per_s_{suffix}": done.replay.puts_per_s,
            }

        return trial

    variants = {"file": file_store(workload, ""), "file_delta": file_store(delta_workload, "_records_on")}
    if bootstrap is not None:
        variants |= {
            "kafka_wire_off": kafka(workload, False, "wire_off"),
            "kafka_wire_on": kafka(workload, True, "wire_on"),
            "kafka_records_on": kafka(delta_workload, True, "records_on"),
        }
    return variants


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
        trials = asyncio.run(alternate(_variants(workload, delta_workload, bootstrap), repeats, work_dir))
        figures.update(trials.merged())
        results.append(
            {
                "shape": shape.__dict__ | {"label": shape.label()},
                "figures": figures,
                "runs": trials.flat_runs(),
            }
        )
    return results


def corner_figures(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The grid's corners the targets read: the largest shape's figures, and its ratios to two other shapes.

    ``largest_vs_smallest`` divides each figure at the largest shape (most turns, largest prompt) by the same
    figure at the smallest; ``largest_vs_fewest_turns`` by the fewest turns at the largest prompt ("flat").
    A corner that is the largest shape itself gives no ratio: one shape compared with itself would read as met.
    """
    grid = {(int(r["shape"]["turns"]), int(r["shape"]["prompt_tokens"])): r["figures"] for r in results}
    if not grid:
        return {}
    turns = sorted({t for t, _ in grid})
    prompts = sorted({p for _, p in grid})
    largest = grid[(turns[-1], prompts[-1])]
    corners: dict[str, dict[str, float]] = {"largest": dict(largest)}
    for name, other in (
        ("largest_vs_smallest", (turns[0], prompts[0])),
        ("largest_vs_fewest_turns", (turns[0], prompts[-1])),
    ):
        if other == (turns[-1], prompts[-1]):
            continue
        base = grid[other]
        corners[name] = {key: value / base[key] for key, value in largest.items() if base.get(key)}
    return corners

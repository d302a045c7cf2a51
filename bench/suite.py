"""The whole run: every section the issues' target tables need, side by side in one process run.

Sections (``--only``): ``main`` (the main load on Gym 0.7.0's file store, tokcap's file store and Kafka,
with references, replay and the apply step), ``batch`` (200 rollouts frozen at once, ``bench.batch_freeze``),
``workers`` (apply with 1 and 2 worker processes, ``bench.workers``), ``growth`` (the growth grid with
deltas on and off, ``bench.growth``) and ``resolve`` (Kafka lineage resolve latency, ``bench.lineage_resolve``).
Inside a section, repeats are interleaved (reference, Gym, file store, Kafka, then again), so drift in
the machine's load touches every column alike; each figure is the median over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.batch_freeze import BatchShape, load_gym_store, run_batch_freeze
from bench.cpu_cost import measure_call_costs
from bench.file_store_trial import run_file_store_trial
from bench.growth import measure_growth
from bench.growth import wire_sizes as wire_sizes_per_call
from bench.kafka_external import run_with_materializer_process
from bench.kafka_split import run_with_trainer_process
from bench.kafka_trial import run_kafka_trial, warm_up_broker
from bench.lineage_resolve import kafka_resolve, resolve_args
from bench.load import BenchmarkCheckError, PreparedWorkload, drive, prepare
from bench.options import BenchOptions, WorkloadShape
from bench.physical import create_rate, encode_and_write_rate, fsync_rate, rename_rate, syncfs_rate
from bench.resolve_probe import probe_under_main_load
from bench.sizes import wire_sizes
from bench.stats import median, percentile
from bench.workers import run_workers, summarize

__all__ = ["machine_description", "measure_shape", "run_suite"]

_REFERENCE_SECONDS = 1.0

Progress = Callable[[str], None]


def machine_description(directory: Path) -> dict[str, Any]:
    """Where the numbers come from: CPU, cores, memory, Python and the benchmark directory's filesystem."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gb = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gb = int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    filesystem = "unknown"
    try:
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            resolved = str(directory.resolve())
            if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(
                best
            ):
                best, filesystem = mount, f"{kind} on {device} (mounted at {mount})"
    except OSError:
        pass
    import os

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(memory_gb, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "filesystem": filesystem,
    }


def _fresh(parent: Path, name: str) -> Path:
    path = parent / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


async def measure_shape(
    shape: WorkloadShape,
    repeats: int,
    bootstrap: str | None,
    work_dir: Path,
    progress: Progress,
    with_materializer_process: bool = False,
    with_gym: bool = False,
) -> dict[str, Any]:
    """Every figure of one workload shape, as medians over ``repeats`` interleaved runs.

    ``with_materializer_process`` adds two more Kafka loads: one whose materializer runs in its own process,
    one whose freezes a trainer process serves (its source and in-process materializer there, the sinks here);
    ``with_gym`` adds Gym 0.7.0's own file store on the same entries as the anchor column.
    """
    workload: PreparedWorkload = prepare(shape, "bench")
    gym_store_class: type[Any] | None = None
    gym_workload = workload
    if with_gym:
        gym_store_class, gym_entry_class = load_gym_store()
        gym_workload = replace(
            workload,
            slots=[
                [
                    (rid, [gym_entry_class.model_validate(e.model_dump()) for e in entries])
                    for rid, entries in slot
                ]
                for slot in workload.slots
            ],
        )
    sizes = wire_sizes(workload)
    runs: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    for repeat in range(repeats):
        progress(f"{shape.label()}: repeat {repeat + 1}/{repeats}")
        # Each repeat writes into directories of its own, removed with the work directory after the last
        # section: on ext4 a removal of thousands of files slows the file creates of the next half minute,
        # which every trial here makes (a freeze creates the state's temporary file).
        repeat_dir = work_dir / f"main-repeat-{repeat + 1}"
        reference_dir = _fresh(repeat_dir, "reference")
        record("fsync_per_s", fsync_rate(reference_dir, _REFERENCE_SECONDS))
        record("syncfs_per_s", syncfs_rate(reference_dir, _REFERENCE_SECONDS))
        record("rename_per_s", rename_rate(reference_dir, _REFERENCE_SECONDS / 2))
        record("create_per_s", create_rate(reference_dir, _REFERENCE_SECONDS / 2))
        encode = encode_and_write_rate(reference_dir, shape)
        record("orjson_entries_per_s", encode.entries_per_s)
        record("orjson_tokens_per_s", encode.tokens_per_s)
        gc.collect()

        costs = measure_call_costs(workload, _fresh(repeat_dir, "call-costs"))
        record("file_intent_cpu_us", costs.intent_cpu_us)
        record("file_put_cpu_us", costs.put_cpu_us)
        record("file_freeze_cpu_us", costs.freeze_cpu_us)
        record("file_intent_wall_us", costs.intent_wall_us)
        record("file_put_wall_us", costs.put_wall_us)
        record("file_freeze_unloaded_ms", costs.freeze_wall_us / 1000.0)
        record("file_cpu_bound_puts_per_s", costs.cpu_bound_puts_per_s)
        gc.collect()

        if gym_store_class is not None:
            gym_store = gym_store_class(_fresh(repeat_dir, "gym-store"))
            try:
                gym_load = await drive(gym_workload, gym_store)
            finally:
                await gym_store.close()
            record("gym_puts_per_s", gym_load.puts_per_s)
            record("gym_calls_per_s", gym_load.calls_per_s)
            record("gym_generated_tokens_per_s", gym_load.generated_tokens_per_s)
            record("gym_freeze_p50_ms", percentile(gym_load.freeze_under_load_ms, 0.50))
            record("gym_freeze_p99_ms", percentile(gym_load.freeze_under_load_ms, 0.99))
            gc.collect()

        trial = await run_file_store_trial(workload, _fresh(repeat_dir, "file-store"))
        record("file_puts_per_s", trial.load.puts_per_s)
        record("file_calls_per_s", trial.load.calls_per_s)
        record("file_generated_tokens_per_s", trial.load.generated_tokens_per_s)
        record("file_freeze_p50_ms", percentile(trial.load.freeze_under_load_ms, 0.50))
        record("file_freeze_p99_ms", percentile(trial.load.freeze_under_load_ms, 0.99))
        record("file_freezes_under_load", len(trial.load.freeze_under_load_ms))
        record("file_puts_per_sync", trial.puts_per_sync)
        record("file_disk_bytes_per_token", trial.disk_bytes / workload.tokens)
        record("file_entry_bytes_per_token", trial.entry_file_bytes / workload.tokens)
        gc.collect()

        if bootstrap is not None:
            kafka = await run_kafka_trial(workload, bootstrap, _fresh(repeat_dir, "kafka"))
            record("kafka_puts_per_s", kafka.load.puts_per_s)
            record("kafka_calls_per_s", kafka.load.calls_per_s)
            record("kafka_generated_tokens_per_s", kafka.load.generated_tokens_per_s)
            record("kafka_freeze_p50_ms", percentile(kafka.load.freeze_under_load_ms, 0.50))
            record("kafka_freeze_p99_ms", percentile(kafka.load.freeze_under_load_ms, 0.99))
            record("kafka_freezes_under_load", len(kafka.load.freeze_under_load_ms))
            record("replay_seconds", kafka.replay.seconds)
            record("replay_events_per_s", kafka.replay.events_per_s)
            record("replay_puts_per_s", kafka.replay.puts_per_s)
            record("replay_tokens_per_s", kafka.replay.tokens_per_s)
            record("replay_events", kafka.replay.events)
            record("replay_disk_bytes_per_token", kafka.replay.disk_bytes / workload.tokens)
            record("kafka_lag_at_end_of_puts", kafka.lag_at_end_of_puts)
            if kafka.live_counters is not None:
                record("kafka_freezes_answered_ahead", kafka.live_counters.freezes_answered_ahead)
            record("apply_events_per_s", kafka.apply.events_per_s)
            record("apply_tokens_per_s", kafka.apply.tokens_per_s)
            gc.collect()
            if with_materializer_process:
                external = await run_with_materializer_process(
                    workload, bootstrap, _fresh(repeat_dir, "kafka-external")
                )
                record("kafka_ext_puts_per_s", external.load.puts_per_s)
                record("kafka_ext_freeze_p50_ms", percentile(external.load.freeze_under_load_ms, 0.50))
                record("kafka_ext_freeze_p99_ms", percentile(external.load.freeze_under_load_ms, 0.99))
                record("kafka_ext_lag_at_end_of_puts", external.lag_at_end_of_puts)
                gc.collect()
                split = await run_with_trainer_process(workload, bootstrap, _fresh(repeat_dir, "kafka-split"))
                record("kafka_split_puts_per_s", split.load.puts_per_s)
                record("kafka_split_freeze_p50_ms", percentile(split.trainer_freeze_under_load_ms, 0.50))
                record("kafka_split_freeze_p99_ms", percentile(split.trainer_freeze_under_load_ms, 0.99))
                record("kafka_split_round_trip_p99_ms", percentile(split.load.freeze_under_load_ms, 0.99))
                gc.collect()

    figures: dict[str, Any] = {name: median(values) for name, values in runs.items()}
    figures["wire_bytes_per_token"] = sizes.packed_per_token
    for switch, on in (("off", False), ("on", True)):
        # Per call, against the call's new tokens packed: wire deltas off and on (``python -m bench.growth``).
        per_call = wire_sizes_per_call(workload, wire_deltas=on)
        figures.update({f"{name}_wire_{switch}": value for name, value in per_call.items()})
    figures["json_event_bytes_per_token"] = sizes.json_per_token
    figures["puts"] = workload.puts
    figures["tokens"] = workload.tokens
    figures["generated_tokens"] = workload.generated_tokens
    figures["ratios"] = _ratios(figures)
    return {"shape": shape.__dict__ | {"label": shape.label()}, "figures": figures, "runs": runs}


def _ratios(figures: dict[str, Any]) -> dict[str, float]:
    """The ratios the targets name, from the medians of one shape."""
    ratios = {
        "file_puts_vs_fsync": figures["file_puts_per_s"] / figures["fsync_per_s"],
        "file_cpu_bound_puts_vs_fsync": figures["file_cpu_bound_puts_per_s"] / figures["fsync_per_s"],
    }
    if "gym_puts_per_s" in figures:
        ratios["file_puts_vs_gym"] = figures["file_puts_per_s"] / figures["gym_puts_per_s"]
        if "kafka_puts_per_s" in figures:
            ratios["kafka_puts_vs_gym"] = figures["kafka_puts_per_s"] / figures["gym_puts_per_s"]
    if "kafka_puts_per_s" in figures:
        ratios["kafka_puts_vs_file_puts"] = figures["kafka_puts_per_s"] / figures["file_puts_per_s"]
        ratios["replay_vs_orjson"] = figures["replay_puts_per_s"] / figures["orjson_entries_per_s"]
    return ratios


def _resolve(options: BenchOptions, bootstrap: str, work_dir: Path, progress: Progress) -> dict[str, Any]:
    """Kafka resolve latency p50/p99 under the main load, median over repeats, measured two ways.

    A probe process resolves its own rollouts on the run topic while the main load runs (``bench.resolve_probe``),
    and the main shape's rollouts resolve in the load's own closed loop (``bench.lineage_resolve``).
    """
    shape = options.shape
    workload = prepare(shape, "probe")
    args = resolve_args(
        rollouts=shape.rollouts,
        turns=shape.turns,
        prompt_tokens=shape.prompt_tokens,
        generated_tokens=shape.generated_tokens,
        tool_tokens=shape.tool_tokens,
    )
    runs: dict[str, list[float]] = {
        name: [] for name in ("kafka_p50_ms", "kafka_p99_ms", "kafka_max_ms", "wrong")
    } | {
        name: []
        for name in ("probe_p50_ms", "probe_p99_ms", "probe_max_ms", "probe_resolves", "probe_puts_per_s")
    }
    for repeat in range(options.repeats):
        progress(f"resolve: repeat {repeat + 1}/{options.repeats}")
        probe_dir = _fresh(work_dir / f"resolve-repeat-{repeat + 1}", "probe")
        probe = asyncio.run(probe_under_main_load(workload, bootstrap, probe_dir))
        if probe.wrong:
            raise BenchmarkCheckError(f"{probe.wrong} probe continuations resolved to another parent")
        probe_ms = [value * 1000.0 for value in probe.latencies]
        runs["probe_p50_ms"].append(percentile(probe_ms, 0.50))
        runs["probe_p99_ms"].append(percentile(probe_ms, 0.99))
        runs["probe_max_ms"].append(max(probe_ms) if probe_ms else float("nan"))
        runs["probe_resolves"].append(float(len(probe_ms)))
        runs["probe_puts_per_s"].append(probe.load.puts_per_s)
        latencies, wrong = kafka_resolve(args, bootstrap)
        ms = [value * 1000.0 for value in latencies]
        runs["kafka_p50_ms"].append(percentile(ms, 0.50))
        runs["kafka_p99_ms"].append(percentile(ms, 0.99))
        runs["kafka_max_ms"].append(max(ms) if ms else float("nan"))
        runs["wrong"].append(float(wrong))
        if wrong:
            raise BenchmarkCheckError(
                f"{wrong} continuations resolved to another parent than the previous call"
            )
    figures: dict[str, Any] = {name: median(values) for name, values in runs.items()}
    figures["resolves"] = len(latencies)
    return {"figures": figures, "runs": runs}


def _workers(options: BenchOptions, bootstrap: str, work_dir: Path, progress: Progress) -> dict[str, Any]:
    """Apply rate of a pre-filled topic with 1 and 2 worker processes, trials alternating."""
    progress(
        f"workers: filling a topic ({options.workers_rollouts} rollouts x {options.workers_turns} turns)"
    )
    args = argparse.Namespace(
        rollouts=options.workers_rollouts,
        turns=options.workers_turns,
        partitions=4,
        prompt_tokens=options.shape.prompt_tokens,
        generated_tokens=options.shape.generated_tokens,
    )
    counts = [1, 2]
    results = run_workers(bootstrap, args, counts, options.workers_trials, _fresh(work_dir, "workers"))
    runs = {
        str(n): [
            {
                "events": f.events,
                "events_per_s": f.events_per_s,
                "cpu_s_per_event": f.cpu_s_per_event,
                "per_worker_events_per_s": [w.events_per_s for w in f.per_worker],
            }
            for f in figures
        ]
        for n, figures in results.items()
    }
    return {
        "rollouts": args.rollouts,
        "turns": args.turns,
        "partitions": args.partitions,
        "trials": options.workers_trials,
        "figures": summarize(results),
        "runs": runs,
    }


def run_suite(options: BenchOptions, bootstrap: str | None, progress: Progress) -> dict[str, Any]:
    """Measure every selected section (``options.only``) and return everything as JSON-ready data.

    Sections needing a broker are skipped without one. Each section runs its trials interleaved inside
    it, so drift touches its columns alike.
    """
    started = time.time()
    parent = options.work_dir or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="tokcap-bench-", dir=parent))
    results: dict[str, Any] = {}
    try:
        if bootstrap is not None:
            asyncio.run(warm_up_broker(bootstrap))
        if "main" in options.only:
            results["main"] = asyncio.run(
                measure_shape(
                    options.shape,
                    options.repeats,
                    bootstrap,
                    work_dir,
                    progress,
                    with_materializer_process=True,
                    with_gym=True,
                )
            )
        if "batch" in options.only:
            batch = BatchShape(rollouts=options.batch_rollouts)
            progress(f"batch freeze: {batch.rollouts} rollouts x {batch.turns} turns, all frozen at once")
            results["batch"] = asyncio.run(
                run_batch_freeze(batch, options.repeats, bootstrap, work_dir, main_load=False)
            )
        if "workers" in options.only and bootstrap is not None:
            results["workers"] = _workers(options, bootstrap, work_dir, progress)
        if "growth" in options.only:
            progress("growth grid")
            results["growth"] = measure_growth(options, bootstrap, work_dir, repeats=options.repeats)
        if "resolve" in options.only and bootstrap is not None:
            results["resolve"] = _resolve(options, bootstrap, work_dir, progress)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": machine_description(parent),
        "options": options.to_json(),
        "kafka": bootstrap is not None,
        **results,
    }

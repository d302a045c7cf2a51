"""The whole run: every scenario of ``bench.scenarios`` that ``--only`` selects, measured in one process run.

Inside a scenario the variants take turns through ``bench.harness`` (reference, Gym, file store, Kafka, then
the other way round), so drift in the machine's load touches every column alike; each figure is the median
over trials. Scenarios with a trial function run each trial in a fresh interpreter; the others run here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.batch_freeze import BatchShape, load_gym_store, run_batch_freeze
from bench.cpu_cost import measure_call_costs
from bench.crash_workload import WorkloadPlan
from bench.file_floor import floor_variants
from bench.file_store_trial import run_file_store_trial
from bench.growth import corner_figures, measure_growth
from bench.growth import wire_sizes as wire_sizes_per_call
from bench.harness import REPO, Progress, Trials, Variant, alternate, in_fresh_process, machine_description
from bench.intents import measure_intents
from bench.journal_crash import run_journal_crash
from bench.kafka_external import run_with_materializer_process
from bench.kafka_split import run_with_trainer_process
from bench.kafka_trial import run_kafka_trial, warm_up_broker
from bench.ledger_start import LedgerStartShape, run_ledger_start
from bench.lineage_resolve import file_resolve, kafka_resolve, long_rollout_figures, resolve_args
from bench.load import BenchmarkCheckError, LoadResult, PreparedWorkload, drive, prepare
from bench.metrics_cost import measure_metrics_cost
from bench.options import BenchOptions, WorkloadShape
from bench.physical import create_rate, encode_and_write_rate, fsync_rate, rename_rate, syncfs_rate
from bench.resolve_probe import probe_under_main_load
from bench.scenarios import Scenario, by_name
from bench.sizes import wire_sizes
from bench.staging import run_staging, staging_figures
from bench.stats import percentile
from bench.trials import gym_workload
from bench.workers import run_workers

__all__ = ["measure_shape", "run_suite"]

_REFERENCE_SECONDS = 1.0
_TRIALS = REPO / "bench" / "trials.py"


class BaselineMissingError(ValueError):
    """A scenario that compares two checkouts was asked for without ``--baseline``, or with a tree that is not one."""


def _latencies(prefix: str, milliseconds: Sequence[float]) -> dict[str, float]:
    """p50 and p99 of latencies, named ``{prefix}_p50_ms`` and ``{prefix}_p99_ms``."""
    return {
        f"{prefix}_p50_ms": percentile(milliseconds, 0.50),
        f"{prefix}_p99_ms": percentile(milliseconds, 0.99),
    }


def _load(prefix: str, load: LoadResult) -> dict[str, float]:
    """What every main-load column reports: put/s, calls/s, generated tokens/s, freeze p50/p99 under load."""
    return {
        f"{prefix}_puts_per_s": load.puts_per_s,
        f"{prefix}_calls_per_s": load.calls_per_s,
        f"{prefix}_generated_tokens_per_s": load.generated_tokens_per_s,
        **_latencies(f"{prefix}_freeze", load.freeze_under_load_ms),
    }


def _counters(prefix: str, counters: Any) -> dict[str, float]:
    """Every numeric counter a live materializer kept, whatever counters this tree's materializer has."""
    if counters is None or not dataclasses.is_dataclass(counters):
        return {}
    return {
        f"{prefix}_{name}": float(value)
        for name, value in dataclasses.asdict(counters).items()  # type: ignore[arg-type]
        if isinstance(value, int | float)
    }


def _main_variants(
    workload: PreparedWorkload,
    gyms: PreparedWorkload,
    gym_store_class: type[Any],
    bootstrap: str | None,
) -> dict[str, Variant]:
    """The columns of the main table, each one trial of the main load (or of its physical reference)."""
    shape = workload.shape

    async def reference(directory: Path) -> dict[str, float]:
        encode = encode_and_write_rate(directory, shape)
        return {
            "fsync_per_s": fsync_rate(directory, _REFERENCE_SECONDS),
            "syncfs_per_s": syncfs_rate(directory, _REFERENCE_SECONDS),
            "rename_per_s": rename_rate(directory, _REFERENCE_SECONDS / 2),
            "create_per_s": create_rate(directory, _REFERENCE_SECONDS / 2),
            "orjson_entries_per_s": encode.entries_per_s,
            "orjson_tokens_per_s": encode.tokens_per_s,
        }

    async def call_costs(directory: Path) -> dict[str, float]:
        costs = measure_call_costs(workload, directory)
        return {
            "file_intent_cpu_us": costs.intent_cpu_us,
            "file_put_cpu_us": costs.put_cpu_us,
            "file_freeze_cpu_us": costs.freeze_cpu_us,
            "file_intent_wall_us": costs.intent_wall_us,
            "file_put_wall_us": costs.put_wall_us,
            "file_freeze_unloaded_ms": costs.freeze_wall_us / 1000.0,
            "file_cpu_bound_puts_per_s": costs.cpu_bound_puts_per_s,
        }

    async def gym(directory: Path) -> dict[str, float]:
        gym_store = gym_store_class(directory)
        try:
            return _load("gym", await drive(gyms, gym_store))
        finally:
            await gym_store.close()

    async def file(directory: Path) -> dict[str, float]:
        trial = await run_file_store_trial(workload, directory)
        return {
            **_load("file", trial.load),
            "file_freezes_under_load": float(len(trial.load.freeze_under_load_ms)),
            "file_puts_per_sync": trial.puts_per_sync,
            "file_disk_bytes_per_token": trial.disk_bytes / workload.tokens,
            "file_entry_bytes_per_token": trial.entry_file_bytes / workload.tokens,
        }

    async def kafka(directory: Path) -> dict[str, float]:
        assert bootstrap is not None
        trial = await run_kafka_trial(workload, bootstrap, directory, replay_in_workers=True)
        assert trial.one_worker_replay is not None and trial.parallel_replay is not None
        return {
            **_load("kafka", trial.load),
            "kafka_freezes_under_load": float(len(trial.load.freeze_under_load_ms)),
            "replay_seconds": trial.replay.seconds,
            "replay_events_per_s": trial.replay.events_per_s,
            "replay_puts_per_s": trial.replay.puts_per_s,
            "replay_tokens_per_s": trial.replay.tokens_per_s,
            "replay_events": float(trial.replay.events),
            "replay_disk_bytes_per_token": trial.replay.disk_bytes / workload.tokens,
            "replay_one_worker_puts_per_s": trial.one_worker_replay.puts_per_s,
            "replay_workers_seconds": trial.parallel_replay.seconds,
            "replay_workers_puts_per_s": trial.parallel_replay.puts_per_s,
            "kafka_lag_at_end_of_puts": float(trial.lag_at_end_of_puts),
            **_counters("kafka_materializer", trial.live_counters),
            "apply_events_per_s": trial.apply.events_per_s,
            "apply_tokens_per_s": trial.apply.tokens_per_s,
            "apply_cpu_us_per_event": trial.apply.cpu_seconds / trial.apply.events * 1e6,
        }

    async def kafka_ext(directory: Path) -> dict[str, float]:
        assert bootstrap is not None
        external = await run_with_materializer_process(workload, bootstrap, directory)
        return {
            "kafka_ext_puts_per_s": external.load.puts_per_s,
            **_latencies("kafka_ext_freeze", external.load.freeze_under_load_ms),
            "kafka_ext_lag_at_end_of_puts": float(external.lag_at_end_of_puts),
        }

    async def kafka_split(directory: Path) -> dict[str, float]:
        assert bootstrap is not None
        split = await run_with_trainer_process(workload, bootstrap, directory)
        return {
            "kafka_split_puts_per_s": split.load.puts_per_s,
            **_latencies("kafka_split_freeze", split.trainer_freeze_under_load_ms),
            "kafka_split_round_trip_p99_ms": percentile(split.load.freeze_under_load_ms, 0.99),
        }

    variants: dict[str, Variant] = {
        "reference": reference,
        "call_costs": call_costs,
        "gym": gym,
        "file": file,
    }
    if bootstrap is not None:
        variants |= {"kafka": kafka, "kafka_ext": kafka_ext, "kafka_split": kafka_split}
    return variants


async def measure_shape(
    shape: WorkloadShape, repeats: int, bootstrap: str | None, work_dir: Path, progress: Progress
) -> dict[str, Any]:
    """Every figure of the main load, medians over ``repeats`` trials of each column, columns taking turns.

    Gym 0.7.0's own file store on the same entries is the anchor column; the Kafka columns run the load
    with the materializer in process, in its own process, and with the trainer in its own process.
    """
    workload: PreparedWorkload = prepare(shape, "bench")
    gym_store_class, gym_entry_class = load_gym_store()
    variants = _main_variants(workload, gym_workload(workload, gym_entry_class), gym_store_class, bootstrap)
    trials = await alternate(variants, repeats, work_dir, lambda line: progress(f"{shape.label()}: {line}"))
    figures: dict[str, Any] = trials.merged()
    sizes = wire_sizes(workload)
    figures["wire_bytes_per_token"] = sizes.packed_per_token
    for switch, on in (("off", False), ("on", True)):
        # Per call, against the call's new tokens packed: wire deltas off and on.
        per_call = wire_sizes_per_call(workload, wire_deltas=on)
        figures.update({f"{name}_wire_{switch}": value for name, value in per_call.items()})
    figures["json_event_bytes_per_token"] = sizes.json_per_token
    figures["puts"] = workload.puts
    figures["tokens"] = workload.tokens
    figures["generated_tokens"] = workload.generated_tokens
    figures["ratios"] = _ratios(figures)
    return {
        "shape": shape.__dict__ | {"label": shape.label()},
        "figures": figures,
        "runs": trials.flat_runs(),
    }


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
        ratios["replay_workers_vs_orjson"] = (
            figures["replay_workers_puts_per_s"] / figures["orjson_entries_per_s"]
        )
    return ratios


def _resolve(options: BenchOptions, bootstrap: str, work_dir: Path, progress: Progress) -> dict[str, Any]:
    """Kafka resolve latency under the main load, measured two ways, taking turns.

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

    def summary(prefix: str, seconds: Sequence[float]) -> dict[str, float]:
        ms = [value * 1000.0 for value in seconds]
        return {**_latencies(prefix, ms), f"{prefix}_max_ms": max(ms) if ms else float("nan")}

    async def probe(directory: Path) -> dict[str, float]:
        done = await probe_under_main_load(workload, bootstrap, directory)
        if done.wrong:
            raise BenchmarkCheckError(f"{done.wrong} probe continuations resolved to another parent")
        return {
            **summary("probe", done.latencies),
            "probe_resolves": float(len(done.latencies)),
            "probe_puts_per_s": done.load.puts_per_s,
        }

    async def closed_loop(directory: Path) -> dict[str, float]:
        latencies, wrong = await asyncio.to_thread(kafka_resolve, args, bootstrap)
        if wrong:
            raise BenchmarkCheckError(
                f"{wrong} continuations resolved to another parent than the previous call"
            )
        return {**summary("kafka", latencies), "resolves": float(len(latencies)), "wrong": float(wrong)}

    async def file_closed_loop(directory: Path) -> dict[str, float]:
        latencies, wrong = await asyncio.to_thread(file_resolve, args, directory)
        if wrong:
            raise BenchmarkCheckError(f"{wrong} file-store continuations resolved to another parent")
        return summary("file", latencies)

    trials = asyncio.run(
        alternate(
            {"probe": probe, "closed_loop": closed_loop, "file_closed_loop": file_closed_loop},
            options.repeats,
            work_dir,
            lambda line: progress(f"resolve: {line}"),
        )
    )
    return {"figures": trials.merged(), "runs": trials.flat_runs()}


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
    measured = run_workers(bootstrap, args, [1, 2], options.workers_trials, work_dir)
    return {
        "rollouts": args.rollouts,
        "turns": args.turns,
        "partitions": args.partitions,
        "trials": options.workers_trials,
        **measured,
    }


def _in_fresh_processes(
    scenario: Scenario, options: BenchOptions, bootstrap: str | None, work_dir: Path
) -> dict[str, Any]:
    """A scenario whose trials each run in a new interpreter: this checkout against ``--baseline``, or settings."""
    assert scenario.trial is not None
    settings: dict[str, Any] = {
        "rollouts": options.shape.rollouts,
        "bootstrap": bootstrap,
        "senders": options.senders,
        "sends": options.sends,
    }
    trees = {name: REPO for name in scenario.variants}
    if scenario.baseline:
        baseline = options.baseline
        needs = "transports/kafka" if scenario.kafka else "tokcap"
        if baseline is None or not (baseline / needs).is_dir():
            raise BaselineMissingError(
                f"scenario {scenario.name} compares this checkout with another: give --baseline DIR, a checkout "
                f"holding {needs}/ (git worktree add DIR REV); got {baseline}"
            )
        trees["baseline"] = baseline.resolve()
    variants = {
        name: in_fresh_process(
            _TRIALS, scenario.trial, settings | dict(scenario.settings.get(name, {})), trees[name]
        )
        for name in scenario.variants
    }
    trials: Trials = asyncio.run(alternate(variants, options.repeats, work_dir, shown=scenario.shown))
    print(trials.table(scenario.shown, scenario.anchor), flush=True)
    return {"variants": {name: str(tree) for name, tree in trees.items()}, **trials.result(scenario.anchor)}


def _file_floor(options: BenchOptions, work_dir: Path, progress: Progress) -> dict[str, Any]:
    """The main load's file work alone beside Gym's store, tokcap's file store and the load's hop alone."""
    scenario = by_name("file_floor")
    variants = floor_variants(prepare(options.shape, "floor"))
    trials = asyncio.run(
        alternate(variants, options.repeats, work_dir, lambda line: progress(f"file floor: {line}"))
    )
    print(trials.table(scenario.shown, scenario.anchor), flush=True)
    return trials.result(scenario.anchor)


def _staging(
    options: BenchOptions, bootstrap: str | None, work_dir: Path, progress: Progress
) -> dict[str, Any]:
    """Engine-side staging beside its floors (and straw-queue with ``--straw``)."""
    progress("staging")
    by_shape, measured, fetches = run_staging(
        work_dir,
        calls=options.staging_calls,
        images=options.staging_images,
        threads=options.staging_threads,
        straw=options.straw,
        bootstrap=bootstrap,
        trials=options.repeats,
    )
    figures = staging_figures(by_shape, measured, fetches, bootstrap)
    print(figures["table"], flush=True)
    return figures


def _journal_crash(
    options: BenchOptions, bootstrap: str | None, work_dir: Path, progress: Progress
) -> dict[str, Any]:
    """Generation-seconds lost per trainer crash, the in-memory store alone and with the journal, side by side."""
    plan = WorkloadPlan(seed=options.shape.seed, steps=options.crash_steps)
    measured = run_journal_crash(
        work_dir, plan, kills=options.crash_kills, bootstrap=bootstrap, trials=options.repeats, say=progress
    )
    print(measured["table"], flush=True)
    return measured


def _scenario(
    name: str, options: BenchOptions, bootstrap: str | None, work_dir: Path, progress: Progress
) -> dict[str, Any] | None:
    """Run one scenario; ``None`` when it needs a broker and there is none."""
    scenario = by_name(name)
    if scenario.kafka and bootstrap is None:
        progress(f"{name}: skipped, it needs a broker")
        return None
    if scenario.trial is not None:
        return _in_fresh_processes(scenario, options, bootstrap, work_dir)
    if name == "main":
        return asyncio.run(measure_shape(options.shape, options.repeats, bootstrap, work_dir, progress))
    if name == "batch":
        batch = BatchShape(rollouts=options.batch_rollouts)
        progress(f"batch freeze: {batch.rollouts} rollouts x {batch.turns} turns, all frozen at once")
        return asyncio.run(run_batch_freeze(batch, options.repeats, bootstrap, work_dir))
    if name == "workers":
        assert bootstrap is not None
        return _workers(options, bootstrap, work_dir, progress)
    if name == "growth":
        progress("growth grid")
        return {"shapes": measure_growth(options, bootstrap, work_dir, repeats=options.repeats)}
    if name == "resolve":
        assert bootstrap is not None
        return _resolve(options, bootstrap, work_dir, progress)
    if name == "staging":
        return _staging(options, bootstrap, work_dir, progress)
    if name == "file_floor":
        return _file_floor(options, work_dir, progress)
    if name == "ledger_start":
        assert bootstrap is not None
        shape = LedgerStartShape(options.ledger_start_calls, options.ledger_start_attachment)
        return run_ledger_start(bootstrap, shape, options.repeats, work_dir, progress)
    if name == "journal_crash":
        return _journal_crash(options, bootstrap, work_dir, progress)
    if name == "resolve_long":
        progress(f"long rollouts of {', '.join(map(str, options.long_rollouts))} calls")
        return {
            "sizes": long_rollout_figures(
                options.long_rollouts, options.long_samples, options.long_build_trials, work_dir, bootstrap
            )
        }
    if name == "intents":
        return {"sizes": asyncio.run(measure_intents(options.intent_pairs, options.repeats, work_dir))}
    if name == "metrics_cost":
        return asyncio.run(measure_metrics_cost(work_dir, options.metrics_puts, max(options.repeats, 5)))
    raise KeyError(f"scenario {name} has no runner")


def run_suite(options: BenchOptions, bootstrap: str | None, progress: Progress) -> dict[str, Any]:
    """Measure every selected scenario (``options.only``) and return everything as JSON-ready data.

    Scenarios needing a broker are skipped without one.
    """
    started = time.time()
    parent = options.work_dir or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="tokcap-bench-", dir=parent))
    results: dict[str, Any] = {}
    try:
        if bootstrap is not None:
            asyncio.run(warm_up_broker(bootstrap))
        for name in options.only:
            measured = _scenario(name, options, bootstrap, work_dir, progress)
            if measured is not None:
                results[name] = measured
        if "growth" in results:
            results["growth_corners"] = corner_figures(results["growth"]["shapes"])
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

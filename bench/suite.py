"""The whole run: references, file store and Kafka trials per workload shape, repeated, summarized.

Repeats are interleaved (reference, file store, Kafka, then again), so drift in the machine's load
touches every figure alike; each figure is the median over repeats.
"""

from __future__ import annotations

import gc
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cpu_cost import measure_call_costs
from bench.file_store_trial import run_file_store_trial
from bench.growth import wire_sizes as wire_sizes_per_call
from bench.kafka_external import run_with_materializer_process
from bench.kafka_trial import run_kafka_trial, warm_up_broker
from bench.load import PreparedWorkload, prepare
from bench.options import BenchOptions, WorkloadShape
from bench.physical import encode_and_write_rate, fsync_rate, rename_rate, syncfs_rate
from bench.sizes import wire_sizes
from bench.stats import median, percentile

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
) -> dict[str, Any]:
    """Every figure of one workload shape, as medians over ``repeats`` interleaved runs.

    ``with_materializer_process`` adds a second Kafka load whose materializer runs in its own process.
    """
    workload: PreparedWorkload = prepare(shape, "bench")
    sizes = wire_sizes(workload)
    runs: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    for repeat in range(repeats):
        progress(f"{shape.label()}: repeat {repeat + 1}/{repeats}")
        reference_dir = _fresh(work_dir, "reference")
        record("fsync_per_s", fsync_rate(reference_dir, _REFERENCE_SECONDS))
        record("syncfs_per_s", syncfs_rate(reference_dir, _REFERENCE_SECONDS))
        record("rename_per_s", rename_rate(reference_dir, _REFERENCE_SECONDS / 2))
        encode = encode_and_write_rate(reference_dir, shape)
        record("orjson_entries_per_s", encode.entries_per_s)
        record("orjson_tokens_per_s", encode.tokens_per_s)
        gc.collect()

        costs = measure_call_costs(workload, _fresh(work_dir, "call-costs"))
        record("file_intent_cpu_us", costs.intent_cpu_us)
        record("file_put_cpu_us", costs.put_cpu_us)
        record("file_freeze_cpu_us", costs.freeze_cpu_us)
        record("file_intent_wall_us", costs.intent_wall_us)
        record("file_put_wall_us", costs.put_wall_us)
        record("file_freeze_unloaded_ms", costs.freeze_wall_us / 1000.0)
        record("file_cpu_bound_puts_per_s", costs.cpu_bound_puts_per_s)
        gc.collect()

        trial = await run_file_store_trial(workload, _fresh(work_dir, "file-store"))
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
            kafka = await run_kafka_trial(workload, bootstrap, _fresh(work_dir, "kafka"))
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
            record("apply_events_per_s", kafka.apply.events_per_s)
            record("apply_tokens_per_s", kafka.apply.tokens_per_s)
            gc.collect()
            if with_materializer_process:
                external = await run_with_materializer_process(
                    workload, bootstrap, _fresh(work_dir, "kafka-external")
                )
                record("kafka_ext_puts_per_s", external.load.puts_per_s)
                record("kafka_ext_freeze_p50_ms", percentile(external.load.freeze_under_load_ms, 0.50))
                record("kafka_ext_freeze_p99_ms", percentile(external.load.freeze_under_load_ms, 0.99))
                record("kafka_ext_lag_at_end_of_puts", external.lag_at_end_of_puts)
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
    if "kafka_puts_per_s" in figures:
        ratios["kafka_puts_vs_file_puts"] = figures["kafka_puts_per_s"] / figures["file_puts_per_s"]
        ratios["replay_vs_orjson"] = figures["replay_puts_per_s"] / figures["orjson_entries_per_s"]
    return ratios


async def run_suite(options: BenchOptions, bootstrap: str | None, progress: Progress) -> dict[str, Any]:
    """Measure the main shape and, unless disabled, the growth grid; return everything as JSON-ready data."""
    started = time.time()
    parent = options.work_dir or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="tokcap-bench-", dir=parent))
    try:
        if bootstrap is not None:
            await warm_up_broker(bootstrap)
        main = await measure_shape(
            options.shape, options.repeats, bootstrap, work_dir, progress, with_materializer_process=True
        )
        growth = []
        if options.growth:
            for shape in options.growth_shapes():
                growth.append(await measure_shape(shape, options.repeats, bootstrap, work_dir, progress))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": machine_description(parent),
        "options": options.to_json(),
        "kafka": bootstrap is not None,
        "main": main,
        "growth": growth,
    }

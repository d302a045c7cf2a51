"""Trials that run in a fresh interpreter each: one function per comparison the harness runs in new processes.

Each function takes the trial's directory and keyword settings (``rollouts``, ``bootstrap``, ...) and returns
its figures. ``bench.harness.in_fresh_process`` runs it with a chosen tree first on ``sys.path``; the file is
read from this checkout, so everything a tree must provide is imported inside the functions, from modules
every tree since the batch section has (``bench.load``, ``bench.file_store_trial``, ``bench.kafka_trial``,
``bench.batch_freeze.load_gym_store``). A setting a trial does not use is ignored, so one set of settings
serves every scenario.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = [
    "apply_cost",
    "apply_rate",
    "file_store",
    "gym_anchor",
    "gym_workload",
    "kafka",
    "load_figures",
    "producer_sends",
    "trainer_split",
]


def gym_workload(workload: Any, gym_entry_class: type[Any]) -> Any:
    """The same prepared workload with every entry as Gym 0.7.0's own ``TokenEntry``, for Gym's store."""
    return replace(
        workload,
        slots=[
            [
                (rid, [gym_entry_class.model_validate(e.model_dump()) for e in entries])
                for rid, entries in slot
            ]
            for slot in workload.slots
        ],
    )


async def gym_anchor(workload: Any, directory: Path) -> Any:
    """Gym 0.7.0's own store driven by the main load on the same entries: the anchor of a trial."""
    from bench.batch_freeze import load_gym_store
    from bench.load import drive

    gym_store_class, gym_entry_class = load_gym_store()
    gym_store = gym_store_class(directory)
    try:
        return await drive(gym_workload(workload, gym_entry_class), gym_store)
    finally:
        await gym_store.close()


def load_figures(load: Any, gym_load: Any) -> dict[str, float]:
    """The main load's figures every load trial returns: put/s, put/s over Gym's, freeze p50 and p99 under load."""
    from bench.stats import percentile

    freezes = load.freeze_under_load_ms
    return {
        "puts_per_s": load.puts_per_s,
        "vs_gym": load.puts_per_s / gym_load.puts_per_s,
        "freeze_p50_ms": percentile(freezes, 0.50),
        "freeze_p99_ms": percentile(freezes, 0.99),
    }


def _workload(rollouts: int, name: str) -> Any:
    from bench.load import prepare
    from bench.options import WorkloadShape

    return prepare(WorkloadShape(rollouts=rollouts), name)


async def file_store(directory: Path, rollouts: int = 64, **_: Any) -> dict[str, float]:
    """Gym's store, then the tree's file store, on the same prepared entries of the main load."""
    from bench.file_store_trial import run_file_store_trial

    workload = _workload(rollouts, "ab")
    gym_load = await gym_anchor(workload, directory / "gym")
    started = time.process_time()
    trial = await run_file_store_trial(workload, directory / "tokcap")
    cpu = time.process_time() - started
    return {**load_figures(trial.load, gym_load), "puts_per_sync": trial.puts_per_sync, "cpu_s": cpu}


async def kafka(directory: Path, bootstrap: str, rollouts: int = 64, **_: Any) -> dict[str, float]:
    """Gym's store, then the tree's Kafka sink and source (in-process materializer), then a replay of the topic."""
    from bench.kafka_trial import run_kafka_trial

    workload = _workload(rollouts, "ab")
    gym_load = await gym_anchor(workload, directory / "gym")
    trial = await run_kafka_trial(workload, bootstrap, directory / "tokcap")
    return {
        **load_figures(trial.load, gym_load),
        "replay_per_s": trial.replay.puts_per_s,
        "backlog": float(trial.lag_at_end_of_puts),
    }


async def apply_rate(directory: Path, bootstrap: str, rollouts: int = 64, **_: Any) -> dict[str, float]:
    """The tree's Kafka main load on a fresh topic, then its apply step (decode + apply) over the topic alone.

    Events per second depend on how many messages a tree writes per call; tokens per second and microseconds
    per put compare trees that write different events.
    """
    from bench.kafka_trial import run_kafka_trial

    workload = _workload(rollouts, "ab")
    trial = await run_kafka_trial(workload, bootstrap, directory / "tokcap")
    apply = trial.apply
    return {
        "events_per_s": apply.events_per_s,
        "tokens_per_s": apply.tokens_per_s,
        "us_per_put": apply.seconds / workload.puts * 1e6,
        "cpu_us_per_event": apply.cpu_seconds / apply.events * 1e6,
        "events": float(apply.events),
    }


async def producer_sends(
    directory: Path, bootstrap: str, senders: int = 64, sends: int = 60, **_: Any
) -> dict[str, float]:
    """Concurrent senders each awaiting one small message at a time through one producer bridge (acks=all).

    What the bridge adds to every intent and put of a sink: sends per second, process CPU per send (the poll
    thread and librdkafka's threads included), send latency p50 and p99.
    """
    from transports.kafka.client.producer_bridge import ProducerBridge
    from transports.kafka.client.topics import ensure_topic
    from transports.kafka.wire.codec import OutgoingMessage

    topic = f"tokcap.bench-sends-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    bridge = ProducerBridge(bootstrap)
    latencies: list[float] = []
    value = b"x" * 2000

    async def sender(name: str, count: int) -> None:
        message = OutgoingMessage(key=name.encode(), value=value, headers=[])
        for _ in range(count):
            started = time.perf_counter()
            await bridge.send(topic, [message], what="bench send")
            latencies.append(time.perf_counter() - started)

    try:
        await sender("warm-up", 50)  # connection, producer id and metadata first
        latencies.clear()
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(sender(f"s{index}", sends) for index in range(senders)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await asyncio.to_thread(bridge.close)
    ordered = sorted(latencies)
    return {
        "sends_per_s": len(ordered) / wall,
        "cpu_us_per_send": cpu / len(ordered) * 1e6,
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[int(len(ordered) * 0.99)] * 1000,
    }


async def trainer_split(
    directory: Path, bootstrap: str, rollouts: int = 64, nice: int = 0, **_: Any
) -> dict[str, float]:
    """The split shape (sinks here, source and materializer in a trainer process), the load at niceness ``nice``.

    The niceness is read back, not assumed, so a trial the kernel refused to renice shows it.
    """
    from bench.kafka_split import run_with_trainer_process
    from bench.stats import percentile

    workload = _workload(rollouts, f"first{os.getpid()}")
    trial = await run_with_trainer_process(workload, bootstrap, directory, load_niceness=nice)
    latencies = trial.trainer_freeze_under_load_ms or trial.trainer_freeze_after_load_ms
    return {
        "freeze_p50_ms": percentile(latencies, 0.50),
        "freeze_p99_ms": percentile(latencies, 0.99),
        "freeze_max_ms": max(latencies),
        "puts_per_s": trial.load.puts_per_s,
        "niceness": float(os.nice(0)),
    }


def _histogram(metric: Any, **labels: str) -> tuple[float, float, list[tuple[float, float]]]:
    """Count, sum and cumulative buckets (upper bound, count) of one tokcap histogram, read from its samples."""
    return _histogram_in(metric.collect(), "", **labels)


def _histogram_in(
    families: Iterable[Any], name: str, **labels: str
) -> tuple[float, float, list[tuple[float, float]]]:
    """Count, sum and cumulative buckets of the histogram ``name`` among metric families ("" for any name)."""
    count = total = 0.0
    buckets: list[tuple[float, float]] = []
    for family in families:
        for sample in family.samples:
            if not sample.name.startswith(name):
                continue
            if any(sample.labels.get(key) != value for key, value in labels.items()):
                continue
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
    return count, total, buckets


def _bucket_p99_ms(buckets: list[tuple[float, float]], count: float) -> float:
    """The upper bound of the bucket that holds the 99th percentile, in milliseconds."""
    for bound, cumulative in sorted(buckets):
        if count and cumulative >= 0.99 * count:
            return bound * 1000
    return float("nan")


async def freeze_phases(
    directory: Path, bootstrap: str, rollouts: int = 64, external: bool = False, **_: Any
) -> dict[str, float]:
    """The Kafka main load, each freeze's time split by tokcap's public metrics.

    The caller times every freeze (p50 and p99 of those started under load). Over all freezes of the trial,
    ``tokcap_source_operation_seconds{kafka,freeze}`` holds the source's whole call,
    ``tokcap_materializer_command_read_delay_seconds{freeze}`` the time from the freeze's log timestamp to the
    materializer fetching it, and ``tokcap_materializer_command_wait_seconds{freeze}`` from that fetch to its
    answer (durable, for a source in another process). What is left of a call (``source_own_mean_ms``) is the
    source's own: the broker's acknowledgement reaching it, its wait on the checkpoint and its read of the
    answer. With ``external`` the materializer runs in its own process and its figures are scraped from its
    ``/metrics``; ``answer_share`` is the materializer's read-to-answer mean over the source's mean.
    """
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from bench.kafka_external import metrics_url, start_materializer_process
    from bench.kafka_trial import KafkaTarget, delete_topic
    from bench.load import drive
    from bench.stats import percentile
    from tokcap.metrics import REGISTRY, SOURCE_SECONDS
    from transports.kafka.client.topics import ensure_topic
    from transports.kafka.sink import KafkaTokenSink
    from transports.kafka.source import KafkaTokenSource

    read_delay, wait = (
        "tokcap_materializer_command_read_delay_seconds",
        "tokcap_materializer_command_wait_seconds",
    )

    def materializer_figures(text: str | None) -> tuple[tuple[float, float], tuple[float, float, list[Any]]]:
        """The freeze's read delay (count, sum) and wait (count, sum, buckets), here or scraped."""
        families = (
            list(text_string_to_metric_families(text)) if text is not None else list(REGISTRY.collect())
        )
        delay_count, delay_total, _ = _histogram_in(families, read_delay, type="freeze")
        return (delay_count, delay_total), _histogram_in(families, wait, type="freeze")

    workload = _workload(rollouts, f"phases{os.getpid()}")
    topic = f"tokcap.bench-phases-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    live = directory / "live"
    live.mkdir(parents=True, exist_ok=True)
    source_before = _histogram(SOURCE_SECONDS, transport="kafka", operation="freeze")
    (delays_before, delay_s_before), (waits_before, wait_s_before, buckets_before) = materializer_figures(
        None
    )
    process = None
    scraped: str | None = None
    try:
        if external:
            log = directory / "materializer.log"
            process = start_materializer_process(bootstrap, topic, live, log, metrics=True)
            (delays_before, delay_s_before), (waits_before, wait_s_before, buckets_before) = (
                (0.0, 0.0),
                (
                    0.0,
                    0.0,
                    [],
                ),
            )
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
        source = KafkaTokenSource(
            bootstrap_servers=bootstrap, store_dir=live, topic=topic, external_materializer=external
        )
        try:
            load = await drive(workload, KafkaTarget(sink, source))
        finally:
            await sink.close()
            await source.close()
        if process is not None:
            with urllib.request.urlopen(metrics_url(directory / "materializer.log"), timeout=10) as answer:
                scraped = answer.read().decode()
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
        await asyncio.to_thread(delete_topic, bootstrap, topic)
    calls, call_s, _call_buckets = _histogram(SOURCE_SECONDS, transport="kafka", operation="freeze")
    calls, call_s = calls - source_before[0], call_s - source_before[1]
    (delays, delay_s), (waits, wait_s, buckets) = materializer_figures(scraped)
    delays, delay_s = delays - delays_before, delay_s - delay_s_before
    waits, wait_s = waits - waits_before, wait_s - wait_s_before
    counted_before = dict(buckets_before)
    wait_buckets = [(bound, cumulative - counted_before.get(bound, 0.0)) for bound, cumulative in buckets]
    if not calls or not waits or not delays:
        raise ValueError(
            f"no freeze was timed ({calls:.0f} source calls, {delays:.0f} reads, {waits:.0f} answers); "
            "is the load empty?"
        )
    call_mean, delay_mean, wait_mean = call_s / calls * 1000, delay_s / delays * 1000, wait_s / waits * 1000
    return {
        "freeze_p50_ms": percentile(load.freeze_under_load_ms, 0.50),
        "freeze_p99_ms": percentile(load.freeze_under_load_ms, 0.99),
        "call_mean_ms": call_mean,
        "read_delay_mean_ms": delay_mean,
        "answer_mean_ms": wait_mean,
        "answer_p99_bucket_ms": _bucket_p99_ms(wait_buckets, waits),
        "source_own_mean_ms": call_mean - delay_mean - wait_mean,
        "answer_share": wait_mean / call_mean,
        "freezes": calls,
    }


def _flat(figures: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Nested figures as one level, ``part.key``; what is not a number is left out."""
    flat: dict[str, float] = {}
    for key, value in figures.items():
        if isinstance(value, Mapping):
            flat |= _flat(value, f"{prefix}{key}.")
        elif isinstance(value, int | float):
            flat[f"{prefix}{key}"] = float(value)
    return flat


async def apply_cost(
    directory: Path,
    rollouts: int = 64,
    gym: bool = True,
    apply_only: bool = False,
    **_: Any,
) -> dict[str, float]:
    """CPU per event of the tree's apply step and per intent + put of its file sink, Gym's store beside them.

    The measuring code is this checkout's ``bench/apply_cost.py``, run against the tree on ``sys.path``.
    """
    import argparse
    import runpy

    measure = runpy.run_path(str(Path(__file__).with_name("apply_cost.py")))["measure"]
    args = argparse.Namespace(
        rollouts=rollouts,
        rounds=2,
        turns=8,
        prompt=1000,
        block=None,
        gym=gym,
        apply_only=apply_only,
    )
    # ``measure`` runs its own event loops, so it runs in a thread with none.
    return _flat(await asyncio.to_thread(measure, args, directory))

"""``tokcap materialize``: the long-running service that projects a run topic into a store directory.

Run one per node that needs snapshots, each on its own directory. It reports, per partition, how far it
has applied and how far behind the log's end it is, and every message it dead-letters (one line each:
partition, offset, rollout, reason). SIGINT or SIGTERM stops it after the current batch,
with the checkpoint written, so a restart resumes exactly where it stopped.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console

from tokcap.cli.metrics_http import DEFAULT_METRICS_HOST, MetricsServer
from tokcap.errors import InvalidInputError
from transports.kafka.cli.options import parse_key_values, parse_partitions, resolve_run_topic
from transports.kafka.client.admin import probe_broker, watermarks
from transports.kafka.materializer.loop import Materializer
from transports.kafka.materializer.readiness import serve_metrics
from transports.kafka.materializer.workers import MaterializerWorkers

__all__ = ["format_lag", "run_materializer", "stop_on_signals"]


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Set ``stop`` on SIGINT or SIGTERM while the block runs; restore the previous handlers after."""

    def handle(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def format_lag(applied: dict[int, int], ends: dict[int, int]) -> str:
    """``p0 1200/1250 (lag 50)  p1 ...``: per partition, applied offsets over the log's end."""
    parts = []
    for partition in sorted(ends):
        done = applied.get(partition, 0)
        parts.append(f"p{partition} {done}/{ends[partition]} (lag {max(0, ends[partition] - done)})")
    return "  ".join(parts)


def run_materializer(
    bootstrap: str,
    directory: Path,
    *,
    run_id: str | None,
    topic: str | None,
    partitions: str | None,
    until_caught_up: bool,
    workers: int = 1,
    interval_s: float,
    block_messages: int | None = None,
    client_options: Sequence[str],
    timeout_s: float,
    console: Console,
    metrics_port: int | None = None,
    metrics_host: str = DEFAULT_METRICS_HOST,
) -> dict[str, Any]:
    """Apply the topic until a signal (or, with ``until_caught_up``, until the log at start is applied).

    With ``metrics_port``, ``/metrics`` and ``/healthz`` are served while it runs
    (``transports.kafka.materializer.readiness``).
    """
    name = resolve_run_topic(run_id, topic)
    chosen = parse_partitions(partitions)
    client_config = parse_key_values(client_options, "-X")
    probe_broker(bootstrap, client_config=client_config, timeout_s=timeout_s)
    marks = watermarks(bootstrap, name, client_config=client_config, timeout_s=timeout_s)
    if chosen is not None:
        missing = sorted(set(chosen) - set(marks))
        if missing:
            raise InvalidInputError(f"topic {name!r} has no partition {missing[0]} (it has {sorted(marks)})")
        marks = {p: marks[p] for p in chosen}
    target = {p: high for p, (_, high) in marks.items()}
    directory.mkdir(parents=True, exist_ok=True)
    if workers > 1:
        if metrics_port is not None:
            raise InvalidInputError(
                "--metrics-port serves the metrics of one materializer process; with --workers each worker is "
                "its own process: run one `tokcap materialize --partitions ...` per worker, each with its port"
            )
        return _run_workers(
            bootstrap, directory, name, workers, target, until_caught_up, interval_s, client_config,
            timeout_s, console, block_messages,
        )  # fmt: skip
    dead_letters: queue.SimpleQueue[Any] = queue.SimpleQueue()
    materializer = Materializer(
        bootstrap,
        name,
        directory,
        chosen,
        consumer_config=client_config,
        on_dead_letter=dead_letters.put,
        block_messages=block_messages,
    )

    def report_dead_letters() -> None:
        # Printed here, not on the materializer's thread, so the lines never interleave with the lag report.
        while not dead_letters.empty():
            console.print(f"dead letter: {dead_letters.get().describe()}", markup=False, soft_wrap=True)

    stop = threading.Event()
    console.print(f"materializing {name} into {directory} (partitions {sorted(marks)}); Ctrl-C stops cleanly")
    server = None
    if metrics_port is not None:
        server = serve_metrics(materializer, host=metrics_host, port=metrics_port)
        console.print(f"serving /metrics and /healthz on http://{server.host}:{server.port}")
    with stop_on_signals(stop), _closing(server):
        materializer.start()
        try:
            next_report = 0.0
            while not stop.is_set():
                materializer.wait_for(0 if chosen is None else chosen[0], -1, 0)
                report_dead_letters()
                applied = materializer.applied_offsets()
                if until_caught_up and all(applied.get(p, 0) >= end for p, end in target.items()):
                    break
                now = time.monotonic()
                if now >= next_report:
                    ends = materializer.high_watermarks()
                    console.print(f"{time.strftime('%H:%M:%S')} {format_lag(applied, ends)}")
                    next_report = now + interval_s
                stop.wait(0.2)
        finally:
            materializer.stop()
            report_dead_letters()
    applied = materializer.applied_offsets()
    console.print(f"stopped; checkpoint written: {format_lag(applied, target)}")
    return {"topic": name, "store_dir": str(directory), "applied_offsets": applied}


@contextmanager
def _closing(server: MetricsServer | None) -> Iterator[None]:
    """Close the metrics server, if any, once the materializer stopped."""
    try:
        yield
    finally:
        if server is not None:
            server.close()


def _run_workers(
    bootstrap: str,
    directory: Path,
    name: str,
    workers: int,
    target: dict[int, int],
    until_caught_up: bool,
    interval_s: float,
    client_config: dict[str, Any],
    timeout_s: float,
    console: Console,
    block_messages: int | None = None,
) -> dict[str, Any]:
    """``--workers N``: N processes apply disjoint partition subsets into the one directory; one lag report."""

    def report_dead_letter(line: str) -> None:
        console.print(f"dead letter: {line}", markup=False, soft_wrap=True)

    supervisor = MaterializerWorkers(
        bootstrap,
        name,
        directory,
        sorted(target),
        workers,
        consumer_config=client_config,
        until=target if until_caught_up else None,
        on_dead_letter=report_dead_letter,
        block_messages=block_messages,
    )
    subsets = "; ".join(f"worker {i}: {list(subset)}" for i, subset in enumerate(supervisor.subsets))
    console.print(
        f"materializing {name} into {directory} with {workers} workers ({subsets}); Ctrl-C stops cleanly"
    )
    stop = threading.Event()
    try:
        with stop_on_signals(stop):
            supervisor.start()
            for index, (pid, subset) in enumerate(zip(supervisor.pids, supervisor.subsets, strict=True)):
                console.print(f"worker {index} (pid {pid}) applies partitions {list(subset)}")
            next_report = 0.0
            while not stop.is_set() and not supervisor.finished():
                supervisor.poll(0.2)
                now = time.monotonic()
                if now >= next_report:
                    marks = watermarks(bootstrap, name, client_config=client_config, timeout_s=timeout_s)
                    ends = {p: marks[p][1] for p in target if p in marks}
                    console.print(
                        f"{time.strftime('%H:%M:%S')} {format_lag(supervisor.applied_offsets(), ends)}"
                    )
                    next_report = now + interval_s
            supervisor.stop()
    finally:
        supervisor.stop()
        supervisor.close()
    applied = supervisor.applied_offsets()
    console.print(f"stopped; checkpoint written: {format_lag(applied, target)}")
    return {"topic": name, "store_dir": str(directory), "applied_offsets": applied, "workers": workers}

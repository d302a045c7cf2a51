"""Materializer apply throughput with N worker processes on a pre-filled topic.

    python -m bench --only workers [--workers-rollouts 1000] [--workers-turns 8] [--dir /dev/shm]

The topic is filled first (per rollout and turn an intent and a put of a 1,000-token prompt and a 200-token
generation, then a freeze per rollout). Then, for N = 1 and 2 taking turns (``bench.harness``),
``MaterializerWorkers`` (what ``tokcap materialize --workers N`` runs) applies the whole topic from offset 0
into an empty directory. Each worker reports when its partitions were assigned (``ready``) and when they were
all applied (``caught_up``), with the CPU seconds of its process (user + system, from ``getrusage``) at each. A
worker is timed from ``ready`` to caught up, so process start-up is left out and every event of the topic is
counted (the consumer's first fetch is included). Per N: events/s in total (all timed events over the first
worker's start to the last one caught up), each worker's events/s averaged, CPU seconds per event, and the
speed-up over N = 1. The directories of every run are compared byte for byte. ``--dir`` puts the store
directories on another filesystem (``/dev/shm`` takes the disk's sync time out, leaving the CPU work).

On a 2-core machine that also runs the broker, 2 workers cannot reach 2x: the broker and the consumers'
fetch threads share the cores. CPU seconds per event show whether a worker's apply got dearer.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import Variant, alternate
from tokcap.log.events import FreezeEvent
from tokcap.log.records import TokenEntry

__all__ = [
    "WorkerFigure",
    "WorkersFigure",
    "WorkersMismatchError",
    "directory_contents",
    "fill_topic",
    "measure_workers",
    "run_workers",
]


class WorkersMismatchError(RuntimeError):
    """Two runs of the workers left different store directories for the same topic."""


@dataclass(frozen=True)
class WorkerFigure:
    """One worker's share of one run."""

    partitions: tuple[int, ...]
    events: int
    seconds: float
    cpu_s: float
    wait_s: float
    """Seconds its threads were runnable but waited for a CPU: the machine's contention, not the worker's work."""

    @property
    def events_per_s(self) -> float:
        """Events this worker applied per second of its own apply time."""
        return self.events / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class WorkersFigure:
    """One run with N workers: each worker's figure and the totals."""

    workers: int
    per_worker: tuple[WorkerFigure, ...]
    seconds: float

    @property
    def events(self) -> int:
        """Events applied by all workers."""
        return sum(worker.events for worker in self.per_worker)

    @property
    def events_per_s(self) -> float:
        """All timed events over the time from the first worker's start to the last one caught up."""
        return self.events / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_s_per_event(self) -> float:
        """CPU seconds of every worker process, per event applied."""
        return sum(worker.cpu_s for worker in self.per_worker) / self.events if self.events else 0.0


def _entry(rollout: str, turn: int, prompt_tokens: int, generated_tokens: int) -> TokenEntry:
    generation = [50_000 + turn * 1000 + n for n in range(generated_tokens)]
    return TokenEntry(
        rollout_id=rollout,
        model_call_id=f"{rollout}-call-{turn}",
        model="policy",
        prompt_token_ids=list(range(1, prompt_tokens + 1)),
        generation_token_ids=generation,
        generation_log_probs=[-0.25] * len(generation),
        output_items=[{"role": "assistant", "content": f"turn {turn} of {rollout}"}],
    )


async def _fill(bootstrap: str, topic: str, args: argparse.Namespace) -> None:
    from transports.kafka import KafkaTokenSink
    from transports.kafka.client.producer_bridge import ProducerBridge
    from transports.kafka.wire.codec import encode_event_messages

    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    bridge = ProducerBridge(bootstrap)
    semaphore = asyncio.Semaphore(64)

    async def rollout(index: int) -> None:
        rollout_id = f"bench-{index:05d}"
        async with semaphore:
            for turn in range(args.turns):
                await sink.begin_call(rollout_id, f"{rollout_id}-call-{turn}")
                await sink.put(_entry(rollout_id, turn, args.prompt_tokens, args.generated_tokens))
            # A freeze as a trainer publishes it, without waiting for any materializer.
            freeze = FreezeEvent(rollout_id=rollout_id, writer="bench-workers")
            await bridge.send(
                topic, encode_event_messages(freeze, next_chunk_group=lambda: "none"), what="freeze"
            )

    try:
        await asyncio.gather(*(rollout(index) for index in range(args.rollouts)))
    finally:
        await sink.close()
        bridge.close()


def fill_topic(bootstrap: str, args: argparse.Namespace) -> tuple[str, dict[int, int]]:
    """Create a topic, fill it with the workload, and return it with each partition's end offset."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from transports.kafka.client.admin import watermarks

    topic = f"tokcap-bench-workers-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=args.partitions, replication_factor=1)])[
        topic
    ].result(60)
    asyncio.run(_fill(bootstrap, topic, args))
    return topic, {p: high for p, (_, high) in watermarks(bootstrap, topic).items()}


def measure_workers(
    bootstrap: str, topic: str, ends: dict[int, int], workers: int, directory: Path
) -> WorkersFigure:
    """Apply the whole topic from offset 0 into an empty directory with N worker processes."""
    from transports.kafka.materializer.workers import MaterializerWorkers

    supervisor = MaterializerWorkers(bootstrap, topic, directory, sorted(ends), workers, until=ends)
    try:
        supervisor.start()
        while not all(caught_up is not None for _, _, caught_up in supervisor.reports()):
            supervisor.poll(0.2)
        supervisor.stop()
    finally:
        supervisor.stop()
        supervisor.close()
    figures = []
    first_start, last_done = float("inf"), 0.0
    for (spec, _, caught_up), start in zip(supervisor.reports(), supervisor.ready_reports(), strict=True):
        # From ``ready`` (partitions assigned, nothing applied yet), not the first progress: a worker reports
        # progress only once a partition is applied, which on a small topic is most of the work.
        assert start is not None and caught_up is not None
        first_start, last_done = min(first_start, start.at), max(last_done, caught_up.at)
        events = sum(caught_up.applied.get(p, 0) - start.applied.get(p, 0) for p in spec.partitions)
        figures.append(
            WorkerFigure(
                spec.partitions,
                events,
                caught_up.at - start.at,
                caught_up.cpu_s - start.cpu_s,
                caught_up.wait_s - start.wait_s,
            )
        )
    return WorkersFigure(workers, tuple(figures), last_done - first_start)


def _delete_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result(60)


def directory_contents(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by its relative path: two projections of one topic must be equal."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_workers(
    bootstrap: str, args: argparse.Namespace, counts: list[int], trials: int, scratch: Path
) -> dict[str, Any]:
    """Fill a topic, then apply it with every worker count, trials alternating, checking the directories agree.

    Every run's directory must be byte-identical to the first, or the projection is not deterministic and
    its rate means nothing. Returns the medians per count (``vs_first``: total events/s over the first
    count's) and every trial's figures.
    """
    topic, ends = fill_topic(bootstrap, args)
    reference: list[dict[str, bytes]] = []

    def variant(n: int) -> Variant:
        async def trial(directory: Path) -> dict[str, float]:
            figure = await asyncio.to_thread(measure_workers, bootstrap, topic, ends, n, directory)
            contents = directory_contents(directory)
            if not reference:
                reference.append(contents)
            elif contents != reference[0]:
                raise WorkersMismatchError(
                    f"the store directory of N={n} differs from the first run's; "
                    "the workers' projection is not deterministic, so its rate means nothing"
                )
            per_worker = [w.events_per_s for w in figure.per_worker]
            return {
                "events_per_s": figure.events_per_s,
                # Each worker's events over its own apply time, averaged over the workers of a run.
                "events_per_s_per_worker": sum(per_worker) / max(1, len(per_worker)),
                "cpu_s_per_event": figure.cpu_s_per_event,
                "events": float(figure.events),
            }

        return trial

    try:
        print(
            f"{topic}: {sum(ends.values())} events over {args.partitions} partitions ({args.rollouts} rollouts x "
            f"{args.turns} turns, intent + put of a {args.prompt_tokens}+{args.generated_tokens}-token call, freeze)"
        )
        trials_run = asyncio.run(alternate({str(n): variant(n) for n in counts}, trials, scratch))
    finally:
        _delete_topic(bootstrap, topic)
    summary = trials_run.summary()
    ratios = trials_run.ratios(str(counts[0]))
    for n, figures in summary.items():
        figures["vs_first"] = ratios[n]["events_per_s"]
    return {"figures": summary, "runs": trials_run.runs}

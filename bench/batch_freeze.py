"""The batch freeze: a trainer freezing its whole batch at once, Gym 0.7.0's file store as anchor.

Per trial: 200 rollouts of 4 turns (1k system prompt) written 32 at a time, each call an intent then a put,
then all 200 frozen at once with ``asyncio.gather``. Trials alternate between Gym 0.7.0's own file store
(loaded from its public wheel, as the Gym tests do), tokcap's file store and tokcap over Kafka, so drift in
the machine's load touches every target alike; each figure is the median over repeats.

For Kafka the run also reports what the materializer did while the batch was frozen (how far behind it was
when the freezes were sent, how many commands went ahead of other rollouts' backlog, the process CPU time of
the freeze phase). Run by ``python -m bench --only batch``.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench.harness import Variant, alternate
from bench.kafka_trial import KafkaTarget, delete_topic, warm_up_broker
from bench.load import BenchmarkCheckError
from bench.options import WorkloadShape
from bench.workload import rollouts_of
from tokcap.files.store import TokenCaptureStore
from transports.kafka.client.topics import ensure_topic
from transports.kafka.sink import KafkaTokenSink
from transports.kafka.source import KafkaTokenSource

__all__ = ["BatchFigures", "BatchShape", "load_gym_store", "run_batch_freeze"]

_TESTS = Path(__file__).resolve().parent.parent / "tests"


@dataclass(frozen=True)
class BatchShape:
    """The batch: rollouts written ``concurrency`` at a time, then all frozen at once."""

    rollouts: int = 200
    turns: int = 4
    prompt_tokens: int = 1000
    generated_tokens: int = 200
    tool_tokens: int = 100
    concurrency: int = 32

    def workload(self) -> WorkloadShape:
        """The synthetic rollouts' shape (one round each)."""
        return WorkloadShape(
            rollouts=self.rollouts,
            rounds=1,
            turns=self.turns,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            tool_tokens=self.tool_tokens,
        )


class _Snapshot(Protocol):
    entries: Sequence[Any]
    incomplete: bool


class _Target(Protocol):
    async def begin_call(self, rollout_id: str, model_call_id: str) -> None: ...

    async def put(self, entry: Any) -> None: ...

    async def freeze(self, rollout_id: str) -> Any: ...


@dataclass
class BatchFigures:
    """One trial of one target."""

    puts: int
    put_seconds: float
    freezes: int
    freeze_seconds: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def puts_per_s(self) -> float:
        """Puts completed per second while writing."""
        return self.puts / self.put_seconds

    @property
    def freezes_per_s(self) -> float:
        """Rollouts frozen per second of the batch freeze."""
        return self.freezes / self.freeze_seconds


async def _write_and_freeze(
    rollouts: list[tuple[str, list[Any]]],
    target: _Target,
    concurrency: int,
    before_freezes: Callable[[], Awaitable[None]] | None = None,
) -> BatchFigures:
    """Write every rollout, ``concurrency`` at a time, then freeze them all at once and check the snapshots."""
    gate = asyncio.Semaphore(concurrency)
    puts = 0

    async def write(rollout_id: str, entries: list[Any]) -> None:
        nonlocal puts
        async with gate:
            for entry in entries:
                await target.begin_call(rollout_id, entry.model_call_id)
                await target.put(entry)
                puts += 1

    started = time.perf_counter()
    await asyncio.gather(*(write(rollout_id, entries) for rollout_id, entries in rollouts))
    put_seconds = time.perf_counter() - started
    if before_freezes is not None:
        await before_freezes()
    started = time.perf_counter()
    snapshots: list[_Snapshot] = await asyncio.gather(
        *(target.freeze(rollout_id) for rollout_id, _ in rollouts)
    )
    freeze_seconds = time.perf_counter() - started
    for (rollout_id, entries), snapshot in zip(rollouts, snapshots, strict=True):
        if len(snapshot.entries) != len(entries) or snapshot.incomplete:
            raise BenchmarkCheckError(
                f"snapshot of {rollout_id} holds {len(snapshot.entries)} entries (incomplete={snapshot.incomplete}),"
                f" but {len(entries)} were written"
            )
    return BatchFigures(puts, put_seconds, len(rollouts), freeze_seconds)


def load_gym_store() -> tuple[type[Any], type[Any]]:
    """Gym 0.7.0's ``TokenCaptureStore`` and ``TokenEntry``, from the cached public wheel (downloaded once).

    The loader is the tests' (``tests/gym_wheel.py``), so the benchmark measures the very code the Gym
    tests drive; nothing of Gym is in this repository.
    """
    if str(_TESTS) not in sys.path:
        sys.path.insert(0, str(_TESTS))
    gym = importlib.import_module("gym_wheel").load_gym()
    return gym.store.TokenCaptureStore, gym.records.TokenEntry


async def _kafka_trial(
    rollouts: list[tuple[str, list[Any]]], bootstrap: str, directory: Path, concurrency: int
) -> BatchFigures:
    topic = f"tokcap.bench-batch-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    source = KafkaTokenSource(bootstrap_servers=bootstrap, store_dir=directory, topic=topic)
    evidence: dict[str, float] = {}
    counted: list[Any] = []

    async def note() -> None:
        materializer = source.materializer
        high = await asyncio.to_thread(materializer.high_watermarks)
        applied = materializer.applied_offsets()
        evidence["lag_when_freezes_sent"] = sum(end - applied.get(p, 0) for p, end in high.items())
        counted.append(materializer.counters())
        evidence["cpu_s_start"] = time.process_time()

    try:
        figures = await _write_and_freeze(rollouts, KafkaTarget(sink, source), concurrency, note)
        cpu = time.process_time() - evidence.pop("cpu_s_start")
        evidence["freeze_phase_cpu_s"] = cpu
        # Every counter the materializer keeps, as what it counted during the freezes.
        before = asdict(counted[0])
        for name, value in asdict(source.materializer.counters()).items():
            if isinstance(value, int | float) and name in before:
                evidence[name] = value - before[name]
        if "messages_swept" in evidence:
            evidence["messages_swept_during_freezes"] = evidence.pop("messages_swept")
        figures.extra = evidence
    finally:
        await sink.close()
        await source.close()
        await asyncio.to_thread(delete_topic, bootstrap, topic)
    return figures


async def run_batch_freeze(
    shape: BatchShape, repeats: int, bootstrap: str | None, work_dir: Path
) -> dict[str, Any]:
    """Every trial, the stores taking turns (``bench.harness``), and the medians and ratios to Gym."""
    gym_store_class, gym_entry_class = load_gym_store()
    ours = [
        (rollout.rollout_id, list(rollout.entries()))
        for slot in rollouts_of(shape.workload(), "batch")
        for rollout in slot
    ]
    gyms = [(rid, [gym_entry_class.model_validate(e.model_dump()) for e in entries]) for rid, entries in ours]
    if bootstrap is not None:
        await warm_up_broker(bootstrap)

    def figures(done: BatchFigures) -> dict[str, float]:
        return {
            "puts_per_s": done.puts_per_s,
            "freezes_per_s": done.freezes_per_s,
            "batch_freeze_ms": done.freeze_seconds * 1000,
            **done.extra,
        }

    async def gym(directory: Path) -> dict[str, float]:
        return figures(await _write_and_freeze(gyms, gym_store_class(directory), shape.concurrency))

    async def file(directory: Path) -> dict[str, float]:
        store = TokenCaptureStore(directory)
        try:
            return figures(await _write_and_freeze(ours, store, shape.concurrency))
        finally:
            await store.close()

    async def kafka(directory: Path) -> dict[str, float]:
        assert bootstrap is not None
        return figures(await _kafka_trial(ours, bootstrap, directory, shape.concurrency))

    variants: dict[str, Variant] = {"gym": gym, "file": file}
    if bootstrap is not None:
        variants["kafka"] = kafka
    trials = await alternate(
        variants, repeats, work_dir, lambda line: print(f"batch freeze: {line}", file=sys.stderr)
    )
    summary = trials.summary()
    ratios = trials.ratios("gym")
    targets = {
        name: {
            **figures,
            "puts_vs_gym": ratios[name]["puts_per_s"],
            "freezes_vs_gym": ratios[name]["freezes_per_s"],
            "runs": trials.runs[name],
        }
        for name, figures in summary.items()
    }
    return {"shape": asdict(shape), "repeats": repeats, "targets": targets}

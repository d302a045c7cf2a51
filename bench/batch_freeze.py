"""``python -m bench.batch_freeze``: a trainer freezing its whole batch at once, Gym 0.7.0's file store as anchor.

Per trial: 200 rollouts of 4 turns (1k system prompt) written 32 at a time, each call an intent then a put,
then all 200 frozen at once with ``asyncio.gather``. Trials alternate between Gym 0.7.0's own file store
(loaded from its public wheel, as the Gym tests do), tokcap's file store and tokcap over Kafka, so drift in
the machine's load touches every target alike; each figure is the median over repeats.

For Kafka the run also reports what the materializer did while the batch was frozen (how far behind it was
when the freezes were sent, how many commands went ahead of other rollouts' backlog, the process CPU time of
the freeze phase), and, unless ``--no-main-load``, the freeze p99 under the main load of ``python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench.broker import local_broker
from bench.file_store_trial import run_file_store_trial
from bench.kafka_trial import delete_topic, run_kafka_trial, warm_up_broker
from bench.load import BenchmarkCheckError, prepare
from bench.options import WorkloadShape
from bench.stats import median, percentile
from bench.workload import rollouts_of
from tokcap.records import TokenEntry
from tokcap.store import TokenCaptureStore
from transports.kafka.materializer import MaterializerCounters
from transports.kafka.sink import KafkaTokenSink
from transports.kafka.source import KafkaTokenSource
from transports.kafka.topics import ensure_topic

__all__ = ["BatchFigures", "BatchShape", "load_gym_store", "main", "run_batch_freeze"]

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


class _KafkaTarget:
    def __init__(self, sink: KafkaTokenSink, source: KafkaTokenSource) -> None:
        self._sink, self._source = sink, source

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self._sink.begin_call(rollout_id, model_call_id)

    async def put(self, entry: TokenEntry) -> None:
        await self._sink.put(entry)

    async def freeze(self, rollout_id: str) -> Any:
        return await self._source.freeze(rollout_id)


async def _kafka_trial(
    rollouts: list[tuple[str, list[Any]]], bootstrap: str, directory: Path, concurrency: int
) -> BatchFigures:
    topic = f"tokcap.bench-batch-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    source = KafkaTokenSource(bootstrap_servers=bootstrap, store_dir=directory, topic=topic)
    evidence: dict[str, float] = {}
    counted: list[MaterializerCounters] = []

    async def note() -> None:
        materializer = source.materializer
        high = await asyncio.to_thread(materializer.high_watermarks)
        applied = materializer.applied_offsets()
        evidence["lag_when_freezes_sent"] = sum(end - applied.get(p, 0) for p, end in high.items())
        counted.append(materializer.counters())
        evidence["cpu_s_start"] = time.process_time()

    try:
        figures = await _write_and_freeze(rollouts, _KafkaTarget(sink, source), concurrency, note)
        cpu = time.process_time() - evidence.pop("cpu_s_start")
        after = source.materializer.counters()
        before = counted[0]
        evidence.update(
            freeze_phase_cpu_s=cpu,
            commands_ahead=after.commands_ahead - before.commands_ahead,
            freezes_answered_ahead=after.freezes_answered_ahead - before.freezes_answered_ahead,
            backlog_skipped=after.backlog_skipped - before.backlog_skipped,
            messages_swept_during_freezes=after.messages_swept - before.messages_swept,
        )
        figures.extra = evidence
    finally:
        await sink.close()
        await source.close()
        await asyncio.to_thread(delete_topic, bootstrap, topic)
    return figures


async def run_batch_freeze(
    shape: BatchShape, repeats: int, bootstrap: str | None, work_dir: Path, main_load: bool
) -> dict[str, Any]:
    """Every trial, alternating targets, and the medians and ratios to Gym."""
    gym_store_class, gym_entry_class = load_gym_store()
    ours = [
        (rollout.rollout_id, list(rollout.entries()))
        for slot in rollouts_of(shape.workload(), "batch")
        for rollout in slot
    ]
    gyms = [(rid, [gym_entry_class.model_validate(e.model_dump()) for e in entries]) for rid, entries in ours]
    runs: dict[str, list[BatchFigures]] = {"gym": [], "file": [], "kafka": []}
    if bootstrap is not None:
        await warm_up_broker(bootstrap)
    # Every trial directory is removed after the last repeat, not after its own: on ext4 a file created within
    # half a minute of thousands being removed costs several times more, and the next repeat's first store
    # (Gym's) would have paid for the removal of all three.
    trial_dirs: list[Path] = []
    try:
        for repeat in range(repeats):
            print(f"batch freeze: repeat {repeat + 1}/{repeats}", file=sys.stderr)
            trial_dir = Path(tempfile.mkdtemp(prefix="batch-", dir=work_dir))
            trial_dirs.append(trial_dir)
            runs["gym"].append(
                await _write_and_freeze(gyms, gym_store_class(trial_dir / "gym"), shape.concurrency)
            )
            store = TokenCaptureStore(trial_dir / "file")
            try:
                runs["file"].append(await _write_and_freeze(ours, store, shape.concurrency))
            finally:
                await store.close()
            if bootstrap is not None:
                runs["kafka"].append(
                    await _kafka_trial(ours, bootstrap, trial_dir / "kafka", shape.concurrency)
                )
    finally:
        for trial_dir in trial_dirs:
            shutil.rmtree(trial_dir, ignore_errors=True)
    summary: dict[str, Any] = {"shape": asdict(shape), "repeats": repeats, "targets": {}}
    gym_puts = median([r.puts_per_s for r in runs["gym"]])
    gym_freezes = median([r.freezes_per_s for r in runs["gym"]])
    for name, trials in runs.items():
        if not trials:
            continue
        puts, freezes = median([r.puts_per_s for r in trials]), median([r.freezes_per_s for r in trials])
        extra_keys = sorted({key for r in trials for key in r.extra})
        summary["targets"][name] = {
            "puts_per_s": puts,
            "freezes_per_s": freezes,
            "puts_vs_gym": puts / gym_puts,
            "freezes_vs_gym": freezes / gym_freezes,
            "batch_freeze_ms": median([r.freeze_seconds * 1000 for r in trials]),
            **{key: median([r.extra[key] for r in trials if key in r.extra]) for key in extra_keys},
            "runs": [
                {"puts_per_s": r.puts_per_s, "freezes_per_s": r.freezes_per_s, **r.extra} for r in trials
            ],
        }
    if main_load:
        summary["main_load"] = await _main_load(bootstrap, work_dir, repeats)
    return summary


async def _main_load(bootstrap: str | None, work_dir: Path, repeats: int) -> dict[str, Any]:
    """Freeze p99 under ``python -m bench``'s main load, file store and Kafka alternating."""
    workload = prepare(WorkloadShape(), "bench")
    p99: dict[str, list[float]] = {"file": [], "kafka": []}
    evidence: dict[str, list[float]] = {
        "kafka_lag_at_end_of_puts": [],
        "commands_ahead": [],
        "backlog_skipped": [],
    }
    for repeat in range(repeats):
        print(f"main load: repeat {repeat + 1}/{repeats}", file=sys.stderr)
        trial_dir = Path(tempfile.mkdtemp(prefix="main-", dir=work_dir))
        try:
            file_trial = await run_file_store_trial(workload, trial_dir / "file")
            p99["file"].append(percentile(file_trial.load.freeze_under_load_ms, 0.99))
            if bootstrap is not None:
                kafka = await run_kafka_trial(workload, bootstrap, trial_dir / "kafka")
                p99["kafka"].append(percentile(kafka.load.freeze_under_load_ms, 0.99))
                evidence["kafka_lag_at_end_of_puts"].append(kafka.lag_at_end_of_puts)
                if kafka.live_counters is not None:
                    evidence["commands_ahead"].append(kafka.live_counters.commands_ahead)
                    evidence["backlog_skipped"].append(kafka.live_counters.backlog_skipped)
        finally:
            shutil.rmtree(trial_dir, ignore_errors=True)
    figures = {f"{name}_freeze_p99_ms": median(values) for name, values in p99.items() if values}
    figures |= {name: median(values) for name, values in evidence.items() if values}
    return figures | {"runs": p99}


def _print(summary: dict[str, Any]) -> None:
    print(f"\n{'target':<8} {'put/s':>8} {'x Gym':>6} {'freezes/s':>10} {'x Gym':>6} {'batch ms':>9}")
    for name, figures in summary["targets"].items():
        print(
            f"{name:<8} {figures['puts_per_s']:>8.0f} {figures['puts_vs_gym']:>6.2f} "
            f"{figures['freezes_per_s']:>10.0f} {figures['freezes_vs_gym']:>6.2f} {figures['batch_freeze_ms']:>9.0f}"
        )
    kafka = summary["targets"].get("kafka")
    if kafka is not None:
        print(
            f"kafka freeze phase: {kafka['lag_when_freezes_sent']:.0f} events not applied when the freezes were "
            f"sent, {kafka['freezes_answered_ahead']:.0f} answered ahead of their apply, "
            f"{kafka['commands_ahead']:.0f} carried out ahead of other rollouts' backlog "
            f"({kafka['backlog_skipped']:.0f} messages jumped), {kafka['freeze_phase_cpu_s']:.2f} s process CPU"
        )
    main_load = summary.get("main_load")
    if main_load is not None:
        figures = ", ".join(f"{k} {v:.0f}" for k, v in main_load.items() if k != "runs")
        print(f"main load: {figures}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the batch-freeze benchmark and print (and optionally write) its figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.batch_freeze", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="trials per target; the median is reported")
    parser.add_argument("--rollouts", type=int, default=BatchShape.rollouts)
    parser.add_argument("--turns", type=int, default=BatchShape.turns)
    parser.add_argument("--concurrency", type=int, default=BatchShape.concurrency)
    parser.add_argument("--bootstrap", default=None, help="use this broker instead of starting a local one")
    parser.add_argument("--no-kafka", action="store_true", help="Gym and tokcap's file store only")
    parser.add_argument("--no-main-load", action="store_true", help="skip the freeze p99 under the main load")
    parser.add_argument("--work-dir", type=Path, default=None, help="parent of the scratch directories")
    parser.add_argument("--output", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    shape = BatchShape(rollouts=args.rollouts, turns=args.turns, concurrency=args.concurrency)
    work_dir = args.work_dir or Path(tempfile.gettempdir())
    work_dir.mkdir(parents=True, exist_ok=True)

    def run(bootstrap: str | None) -> dict[str, Any]:
        return asyncio.run(run_batch_freeze(shape, args.repeats, bootstrap, work_dir, not args.no_main_load))

    if args.no_kafka:
        summary = run(None)
    elif args.bootstrap is not None:
        summary = run(args.bootstrap)
    else:
        with (
            tempfile.TemporaryDirectory(prefix="tokcap-bench-broker-") as state,
            local_broker(Path(state)) as address,
        ):
            summary = run(address)
    _print(summary)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

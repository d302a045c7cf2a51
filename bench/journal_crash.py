"""Generation-seconds lost per trainer crash: the in-memory staging store alone, and with tokcap's journal behind it.

    python -m bench --only journal_crash [--bootstrap HOST:PORT] [--crash-kills 4] [--crash-steps 8]

Each transport (``memory``, the anchor; ``file``; ``kafka`` with a broker) runs the trainer of
``bench.crash_trainer`` in a process of its own and SIGKILLs it at seeded points: inside a stage (the journal
has the call, the in-memory store not yet), between the cursor and the snapshot, and inside the restage of a
restore; every transport gets the same kills. After each kill the trainer is started again and restores from
its last snapshot. The driver reads every acknowledged stage from the trainer's output and, after each restore,
what the trainer holds: the generation-seconds of calls it had and no longer has are what the crash cost
(they are generated again), and every call it holds must be byte-exact (record type, every field, every
attachment) against the workload's plan. The journal's goal is 0 lost; the store alone loses what was staged
since the last snapshot.

Beside it, the cost of one stage through ``JournaledStagingSink`` over the in-memory store, from the same
threads, next to the file floor (the same bytes written to new files and fsynced) and the Kafka floor (the
same bytes produced raw, ``acks=all``, waited for): ``bench.staging``'s floors.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bench.crash_workload import (
    InMemoryStagingStore,
    PlannedCall,
    WorkloadPlan,
    call_digest,
    planned_rollout,
    rollout_of,
)
from bench.harness import REPO, Trials, alternate
from bench.staging import StagedCall, run_floor, run_kafka_floor
from bench.stats import median, percentile

__all__ = [
    "CrashRun",
    "Restore",
    "TRANSPORTS",
    "kill_plan",
    "run_crashes",
    "run_journal_crash",
    "stage_cost",
]

TRANSPORTS = ("memory", "file", "kafka")
"""The anchor first: the in-memory store alone."""

_KILL_POINTS = ("stage", "cursor", "restage")


def kill_plan(seed: int, kills: int, plan: WorkloadPlan) -> list[dict[str, int]]:
    """``kills`` kill points for successive incarnations, seeded; every point is used when ``kills`` >= 3.

    A ``restage`` kill needs a restore with that many calls to stage back; when the restore has fewer, the
    same incarnation is killed at its n-th stage instead.
    """
    rng = random.Random(seed)
    calls = plan.rollouts_per_step * plan.calls_per_rollout * plan.save_period
    points = [point for _ in range(kills // 3 + 1) for point in rng.sample(_KILL_POINTS, 3)]
    if points[0] == "restage":  # the first incarnation restores nothing
        points[0], points[1] = points[1], points[0]
    out = []
    for point in points[:kills]:
        stage = rng.randint(calls // 2, 2 * calls)
        if point == "stage":
            out.append({"stage": stage})
        elif point == "cursor":
            out.append({"cursor": rng.randint(1, 2)})
        else:
            out.append({"restage": rng.randint(1, max(1, calls // 4)), "stage": stage})
    return out


@dataclass(frozen=True)
class Restore:
    """What one completed restore held against what the trainer had before the crash."""

    lost_keys: tuple[str, ...]
    lost_seconds: float
    held: int
    not_exact: tuple[str, ...]
    restaged: int
    pending: int


@dataclass
class CrashRun:
    """Every incarnation of one transport's trainer: acknowledged calls, kills, restores, seconds."""

    transport: str
    acknowledged: int = 0
    kills: int = 0
    restores: list[Restore] = field(default_factory=list)
    generated_seconds: float = 0.0
    wall_seconds: float = 0.0
    trained: int = 0
    killed_at: dict[str, int] = field(default_factory=dict)
    """How many kills hit each point: ``stage``, ``cursor``, ``restage``."""

    @property
    def lost_seconds(self) -> float:
        return sum(restore.lost_seconds for restore in self.restores)

    @property
    def lost_calls(self) -> int:
        return sum(len(restore.lost_keys) for restore in self.restores)

    @property
    def not_exact(self) -> int:
        return sum(len(restore.not_exact) for restore in self.restores)

    def figures(self) -> dict[str, float]:
        """The run as bench figures."""
        return {
            "kills": float(self.kills),
            **{f"kills_at_{point}": float(self.killed_at.get(point, 0)) for point in _KILL_POINTS},
            "acknowledged": float(self.acknowledged),
            "lost_calls": float(self.lost_calls),
            "lost_seconds": self.lost_seconds,
            "lost_seconds_per_crash": self.lost_seconds / self.kills if self.kills else 0.0,
            "not_exact": float(self.not_exact),
            "restaged": float(sum(restore.restaged for restore in self.restores)),
            "pending_trained": float(sum(restore.pending for restore in self.restores)),
            "generated_seconds": self.generated_seconds,
            "trained": float(self.trained),
            "wall_s": self.wall_seconds,
        }


def _expected(plan: WorkloadPlan, key: str) -> PlannedCall:
    low, high = plan.generation_seconds
    calls = planned_rollout(plan.seed, rollout_of(key), plan.calls_per_rollout, low, high)
    return calls[int(key.rpartition("/c")[2])]


def _environment() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


def run_crashes(
    transport: str,
    work: Path,
    plan: WorkloadPlan,
    kills: Sequence[Mapping[str, int]],
    settings: Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
) -> CrashRun:
    """Run the trainer on ``transport`` to its last step, killing one incarnation per entry of ``kills``.

    Raises when an incarnation fails other than by its planned SIGKILL, or the last does not finish.
    """
    work.mkdir(parents=True, exist_ok=True)
    run = CrashRun(transport)
    had: dict[str, float] = {}
    """Every call the trainer had generated and not yet lost or trained on, with its generation-seconds."""
    started = time.perf_counter()
    for incarnation, kill in enumerate([*kills, None]):
        config = {
            "restart": incarnation > 0,
            "work": str(work),
            "plan": plan.to_json(),
            "transport": transport,
            "kill": dict(kill or {}),
            "settings": dict(settings or {}),
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.crash_trainer", json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_environment(),
            cwd=REPO,
        )
        assert process.stdout is not None
        try:
            for line in process.stdout:
                event = orjson.loads(line)
                if "ack" in event:
                    had[event["ack"]] = event["cost"]
                    run.acknowledged += 1
                    run.generated_seconds += event["cost"]
                elif "restored" in event:
                    restore = _priced(plan, had, event["restored"])
                    run.restores.append(restore)
                    had = {key: _expected(plan, key).generation_seconds for key in event["restored"]["held"]}
                elif "killed" in event:
                    run.killed_at[event["killed"]] = run.killed_at.get(event["killed"], 0) + 1
                elif "done" in event:
                    run.trained = event["done"]["trained"]
            code = process.wait(timeout=timeout_s)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        stderr = process.stderr.read().decode() if process.stderr is not None else ""
        if process.stderr is not None:
            process.stderr.close()
        process.stdout.close()
        if code == -9 and kill:
            run.kills += 1
        elif code != 0:
            raise RuntimeError(f"the {transport} trainer failed (exit {code}):\n{stderr[-3000:]}")
        elif kill:
            break  # the run reached its last step before this kill's point: the later kills have no run left
    run.wall_seconds = time.perf_counter() - started
    return run


def _priced(plan: WorkloadPlan, had: Mapping[str, float], restored: Mapping[str, Any]) -> Restore:
    """What a restore lost: calls the trainer had, whose rollout its snapshot did not train on, and no longer
    holds; and which held calls differ from the plan by a byte."""
    held: Mapping[str, str] = restored["held"]
    trained = set(restored["trained"])
    lost = sorted(key for key in had if rollout_of(key) not in trained and key not in held)
    not_exact = []
    for key, digest in held.items():
        expected = _expected(plan, key)
        if digest != call_digest(expected.record, expected.attachments):
            not_exact.append(key)
    return Restore(
        lost_keys=tuple(lost),
        lost_seconds=sum(had[key] for key in lost),
        held=len(held),
        not_exact=tuple(not_exact),
        restaged=int(restored["restaged"]),
        pending=len(restored["pending"]),
    )


# ------------------------------------------------------------------ cost per stage


def _staged_calls(plan: WorkloadPlan, rollouts: int, prefix: str) -> list[StagedCall]:
    low, high = plan.generation_seconds
    out = []
    for number in range(rollouts):
        for call in planned_rollout(plan.seed, f"{prefix}{number:04d}", plan.calls_per_rollout, low, high):
            row = orjson.dumps(call.record.model_dump(mode="json", exclude={"extras"})) + b"\n"
            blobs = [] if call.record.extras is None else [orjson.dumps(call.record.extras)]
            out.append(StagedCall(call.record, call.attachments, (row, *blobs, *call.attachments.values())))
    return out


def stage_cost(
    transport: str, work: Path, calls: Sequence[StagedCall], threads: int, bootstrap: str | None
) -> dict[str, float]:
    """Stage every call once through ``JournaledStagingSink`` over a fresh in-memory store (``memory``: the store
    alone) from ``threads`` threads; microseconds per stage, p50 and p99."""
    from bench.staging import _threaded

    inner = InMemoryStagingStore()
    closers: list[Any] = []
    if transport == "memory":
        sink: Any = inner
    elif transport == "file":
        from tokcap.staging import FileStagingSink, JournaledStagingSink

        sink = JournaledStagingSink(inner, FileStagingSink(work))
    else:
        assert bootstrap is not None
        from bench.staging import _delete_topic, _fresh_topic
        from tokcap.staging import JournaledStagingSink
        from transports.kafka.staging import KafkaStagingSink

        topic = _fresh_topic(bootstrap, f"tokcap.bench-journal-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        journal = KafkaStagingSink(bootstrap_servers=bootstrap, topic=topic, delivery_timeout_s=60)
        sink = JournaledStagingSink(inner, journal)
        closers += [journal.close, partial(_delete_topic, bootstrap, topic)]

    def one(call: StagedCall) -> None:
        result = sink.stage(call.record, attachments=call.attachments)
        if not result.ok:
            raise RuntimeError(f"stage failed: {result.error}")

    try:
        seconds, latencies, _cpu = _threaded(calls, threads, one)
    finally:
        for close in closers:
            close()
    return _per_stage(latencies, seconds, len(calls))


def _per_stage(latencies: Sequence[float], seconds: float, calls: int) -> dict[str, float]:
    return {
        "stage_p50_us": median(latencies) * 1e6,
        "stage_p99_us": percentile(latencies, 0.99) * 1e6,
        "stages_per_s": calls / seconds,
    }


def floor_cost(
    floor: str, work: Path, calls: Sequence[StagedCall], threads: int, bootstrap: str | None
) -> dict[str, float]:
    """The same bytes through ``bench.staging``'s file floor or Kafka floor, per call."""
    if floor == "file_floor":
        measured = run_floor(work, "journal", calls, threads)
    else:
        assert bootstrap is not None
        measured = run_kafka_floor(bootstrap, "journal", calls, threads)
    return _per_stage(measured.latencies, measured.seconds, measured.calls)


# ---------------------------------------------------------------------- the scenario


def journal_gap() -> str | None:
    """Why the journal's columns are not measured, or ``None`` when they can be."""
    import tokcap.staging

    if not hasattr(tokcap.staging, "JournaledStagingSink"):
        return "not measured: tokcap.staging.JournaledStagingSink is not in this tree"
    return None


def kafka_journal_gap() -> str | None:
    """Why the Kafka journal's column is not measured, or ``None`` when it can be."""
    from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

    if not hasattr(KafkaStagingSink, "journal_cursor") or not hasattr(KafkaStagingSource, "journal_store"):
        return "Kafka journal not measured: KafkaStagingSink is no journal (no journal_cursor) in this tree"
    return None


def run_journal_crash(
    work: Path,
    plan: WorkloadPlan,
    *,
    kills: int,
    bootstrap: str | None,
    trials: int,
    cost_rollouts: int = 32,
    say: Any = print,
) -> dict[str, Any]:
    """Every transport's crash run with the same kills, then the cost per stage beside the floors; the table."""
    plan_of_kills = kill_plan(plan.seed, kills, plan)
    gap = journal_gap()
    kafka_gap = None if bootstrap is None or gap is not None else kafka_journal_gap()
    transports = [
        t
        for t in TRANSPORTS
        if t == "memory" or (gap is None and (t != "kafka" or (bootstrap is not None and kafka_gap is None)))
    ]
    runs: dict[str, CrashRun] = {}
    for transport in transports:
        settings: dict[str, Any] = {}
        if transport == "kafka":
            from bench.staging import _fresh_topic

            assert bootstrap is not None
            topic = _fresh_topic(bootstrap, f"tokcap.bench-crash-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            settings = {"bootstrap": bootstrap, "topic": topic}
        say(f"journal_crash: {transport}, kills {plan_of_kills}")
        runs[transport] = run_crashes(transport, work / f"crash-{transport}", plan, plan_of_kills, settings)
        say(f"journal_crash: {transport}: {runs[transport].figures()}")
    calls = _staged_calls(plan, cost_rollouts, "cost")
    writers = [*transports, "file_floor"] + (["kafka_floor"] if bootstrap is not None else [])
    variants = {}
    for writer in writers:
        measure = floor_cost if writer.endswith("_floor") else stage_cost

        async def variant(directory: Path, writer: str = writer, measure: Any = measure) -> dict[str, float]:
            return await asyncio.to_thread(measure, writer, directory, calls, plan.generators, bootstrap)

        variants[writer] = variant
    costs: Trials = asyncio.run(
        alternate(variants, trials, work, lambda line: say(f"journal_crash cost: {line}"))
    )
    summary = costs.summary()
    kafka_ratio = (
        {"kafka_vs_kafka_floor": summary["kafka"]["stage_p50_us"] / summary["kafka_floor"]["stage_p50_us"]}
        if "kafka" in summary and "kafka_floor" in summary
        else {}
    )
    file_ratio = (
        {"file_vs_file_floor": summary["file"]["stage_p50_us"] / summary["file_floor"]["stage_p50_us"]}
        if "file" in summary
        else {}
    )
    result = {
        "plan": plan.to_json(),
        "kills": plan_of_kills,
        "crashes": {name: run.figures() for name, run in runs.items()},
        "cost": summary,
        "ratios": {**file_ratio, **kafka_ratio},
        "runs": costs.runs,
        "not_measured": gap or kafka_gap,
    }
    result["table"] = crash_table(result)
    return result


_NAMES = {"memory": "in-memory store alone", "file": "+ file journal", "kafka": "+ Kafka journal (acks=all)"}


def crash_table(result: Mapping[str, Any]) -> str:
    """Lost generation-seconds per crash side by side, then the cost per stage beside its floors."""
    crashes: Mapping[str, Mapping[str, float]] = result["crashes"]
    names = list(crashes)
    lines = [
        "| figure | " + " | ".join(_NAMES[name] for name in names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    rows = (
        ("trainer SIGKILLs", "kills", "{:.0f}"),
        ("  inside a stage (journal has it, store not yet)", "kills_at_stage", "{:.0f}"),
        ("  between cursor and snapshot", "kills_at_cursor", "{:.0f}"),
        ("  inside a restore's restage", "kills_at_restage", "{:.0f}"),
        ("calls acknowledged", "acknowledged", "{:,.0f}"),
        ("generation-seconds lost per crash", "lost_seconds_per_crash", "{:,.1f}"),
        ("acknowledged calls lost (generated again)", "lost_calls", "{:,.0f}"),
        ("calls restaged from the journal", "restaged", "{:,.0f}"),
        ("committed rollouts trained without regenerating", "pending_trained", "{:,.0f}"),
        ("restored calls not byte-exact", "not_exact", "{:,.0f}"),
        ("generation-seconds spent in all", "generated_seconds", "{:,.0f}"),
    )
    for label, key, form in rows:
        lines.append(f"| {label} | " + " | ".join(form.format(crashes[n][key]) for n in names) + " |")
    cost: Mapping[str, Mapping[str, float]] = result["cost"]
    lines += [
        "",
        "| one stage, same calls, same threads | p50 (us) | p99 (us) | stages/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    labels = {
        "memory": "in-memory store alone",
        "file": "JournaledStagingSink, file journal",
        "file_floor": "file floor (write + fsync of the same bytes)",
        "kafka": "JournaledStagingSink, Kafka journal",
        "kafka_floor": "Kafka floor (raw producer, acks=all, same bytes)",
    }
    for name in ("memory", "file", "file_floor", "kafka", "kafka_floor"):
        if name in cost:
            figures = cost[name]
            lines.append(
                f"| {labels[name]} | {figures['stage_p50_us']:,.0f} | {figures['stage_p99_us']:,.0f} | "
                f"{figures['stages_per_s']:,.0f} |"
            )
    if result.get("not_measured"):
        lines += ["", f"Journal columns: {result['not_measured']}."]
    return "\n".join(lines)

"""The crash harness's trainer SIGKILLed at seeded points and restored, with the Kafka journal (a real broker)
behind its in-memory store: no acknowledged call is lost and every restaged call is byte-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.crash_workload import WorkloadPlan
from bench.journal_crash import kill_plan, run_crashes

_PLAN = WorkloadPlan(seed=11, steps=6)


def test_with_the_kafka_journal_no_acknowledged_call_is_lost_and_every_restaged_call_is_byte_exact(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory.staged_apart("journal-crash", partitions=3)
    settings = {"bootstrap": kafka_bootstrap, "topic": topic}
    run = run_crashes("kafka", tmp_path, _PLAN, kill_plan(_PLAN.seed, 3, _PLAN), settings, timeout_s=60)
    assert run.kills >= 2 and run.restores
    assert run.killed_at.get("restage", 0) >= 1 and run.killed_at.get("cursor", 0) >= 1
    assert run.lost_calls == 0 and run.lost_seconds == 0
    assert run.not_exact == 0
    assert sum(restore.restaged for restore in run.restores) > 0
    assert run.trained >= _PLAN.steps * _PLAN.rollouts_per_step

"""A NeMo RL-shaped trainer SIGKILLed at seeded points (mid-stage, between cursor and snapshot, mid-restage) and
restored from its snapshot: with the file journal behind its in-memory store it loses no acknowledged call and
gets every one back byte for byte; with the store alone it loses what was staged since the snapshot."""

from __future__ import annotations

from pathlib import Path

from bench.crash_workload import WorkloadPlan
from bench.journal_crash import kill_plan, run_crashes

_PLAN = WorkloadPlan(seed=11, steps=6)
_KILLS = kill_plan(_PLAN.seed, 3, _PLAN)


def test_the_kills_cover_every_point_of_the_loop() -> None:
    assert {point for kill in _KILLS for point in kill} >= {"stage", "cursor", "restage"}


def test_with_the_file_journal_no_acknowledged_call_is_lost_and_every_restaged_call_is_byte_exact(
    tmp_path: Path,
) -> None:
    run = run_crashes("file", tmp_path, _PLAN, _KILLS, timeout_s=60)
    assert run.kills >= 2 and run.restores  # a kill planned past the run's last step is not reached
    assert run.killed_at.get("restage", 0) >= 1 and run.killed_at.get("cursor", 0) >= 1
    assert run.lost_calls == 0 and run.lost_seconds == 0
    assert run.not_exact == 0
    assert sum(restore.restaged for restore in run.restores) > 0
    assert run.trained >= _PLAN.steps * _PLAN.rollouts_per_step


def test_the_in_memory_store_alone_loses_the_calls_staged_since_its_snapshot(tmp_path: Path) -> None:
    run = run_crashes("memory", tmp_path, _PLAN, _KILLS, timeout_s=60)
    assert run.kills == len(_KILLS)
    assert run.lost_calls > 0 and run.lost_seconds > 0
    assert run.not_exact == 0

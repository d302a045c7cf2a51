"""The freeze-phase tracer: every freeze of the Kafka main load timed from the caller's side and the materializer's.

Runs against a real broker; no figure is checked against a target, only that each phase is measured for every
freeze started under load and fits inside that freeze's own time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench import freeze_phases
from bench.freeze_phases import FreezePhases, run_traced_load
from bench.load import prepare
from bench.options import WorkloadShape

_CLOCKS_MS = 1.0
"""Slack between the wall clock and the thread's CPU clock, which tick at different moments."""


def test_every_freeze_under_load_is_timed_in_each_phase_and_each_phase_fits_inside_it(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    workload = prepare(WorkloadShape(rollouts=3, rounds=2, turns=2, prompt_tokens=64), "phases-test")
    load, phases = asyncio.run(run_traced_load(workload, kafka_bootstrap, tmp_path))
    assert load.puts == workload.puts
    assert phases.freezes == 6
    under_load = len(phases.total_ms)
    assert under_load >= 3, "the first round's freezes start while the second round puts"
    assert len(phases.ack_ms) == len(phases.wake_ms) == under_load
    assert len(phases.read_ms) == len(phases.answer_wall_ms) == under_load, (
        "an in-process source is answered ahead"
    )
    for index in range(under_load):
        total = phases.total_ms[index]
        assert 0 < phases.ack_ms[index] <= total
        assert 0 < phases.read_ms[index] <= total
        assert phases.answer_cpu_ms[index] <= phases.answer_wall_ms[index] + _CLOCKS_MS
        assert phases.read_ms[index] + phases.answer_wall_ms[index] <= total
        assert phases.wake_ms[index] <= total
    figures = phases.figures()
    assert figures["answered_ahead"] == under_load
    assert figures["answers_wall_ms"] == pytest.approx(sum(phases.answer_wall_ms))


def test_the_command_prints_each_trial_and_the_medians_and_removes_its_directories(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--bootstrap", kafka_bootstrap, "--trials", "1", "--rollouts", "2", "--dir", str(tmp_path)]
    assert freeze_phases.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("trial")] == ["trial 1 kafka"]
    medians = {line.split()[0] for line in lines[lines.index("medians of 1 trials:") + 2 :]}
    assert medians == set(freeze_phases._FIGURES)
    assert list(tmp_path.iterdir()) == [], "trial directories are removed after the last trial"


def test_a_trace_without_a_freeze_under_load_is_refused_rather_than_reported_as_zero() -> None:
    with pytest.raises(ValueError, match="no freeze started under load"):
        FreezePhases(freezes=2).figures()


def test_the_command_refuses_zero_trials(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        freeze_phases.main(["--bootstrap", "127.0.0.1:1", "--trials", "0"])
    assert "--trials and --rollouts must be 1 or more" in capsys.readouterr().err

"""The Kafka A/B scenarios run both trees in alternation against a real broker and print the medians.

Small shapes; no figure is checked, only that each tree ran, in the order the harness promises. The Kafka
load's trial also drives Gym 0.7.0's store (the public wheel, cached by the tests' loader).
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.__main__ import main

_REPO = Path(__file__).resolve().parents[2]
_ORDER = ["trial 1 this", "trial 1 baseline", "trial 2 baseline", "trial 2 this"]


def _run(
    scenario: str, bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> dict:
    """Run one A/B scenario, 2 trials per tree; check the order and that no trial directory is left behind."""
    output, work = tmp_path / "latest.json", tmp_path / "work"
    argv = ["--only", scenario, "--baseline", str(_REPO), "--bootstrap", bootstrap, "--trials", "2", *extra]
    assert main([*argv, "--dir", str(work), "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("trial")] == _ORDER
    assert list(work.iterdir()) == [], "trial directories are removed after the last trial"
    measured: dict = orjson.loads(output.read_bytes())[scenario]
    assert set(measured["medians"]) == {"this", "baseline"}
    return measured


def test_the_kafka_ab_scenario_alternates_the_trees_and_reports_their_medians(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    measured = _run("kafka_ab", kafka_bootstrap, tmp_path, capsys, "--rollouts", "2")
    for figure in ("puts_per_s", "vs_gym", "freeze_p50_ms", "freeze_p99_ms", "replay_per_s", "backlog"):
        assert figure in measured["medians"]["this"], figure


def test_the_sends_ab_scenario_alternates_the_trees_and_reports_their_medians(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    measured = _run("sends_ab", kafka_bootstrap, tmp_path, capsys, "--senders", "2", "--sends", "5")
    for figure in ("sends_per_s", "cpu_us_per_send", "p50_ms", "p99_ms"):
        assert figure in measured["medians"]["baseline"], figure


def test_the_apply_ab_scenario_applies_every_event_of_each_trees_topic(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    measured = _run("apply_ab", kafka_bootstrap, tmp_path, capsys, "--rollouts", "2")
    # 2 slots x 2 rounds of rollouts, each 8 intents, 8 puts and a freeze: 68 events in every trial.
    for tree in ("this", "baseline"):
        assert [trial["events"] for trial in measured["runs"][tree]] == [68.0, 68.0]
        assert measured["medians"][tree]["us_per_put"] > 0

"""The Kafka A/B commands run both trees in alternation against a real broker and print the medians.

Small shapes; no figure is checked, only that each tree ran, in the order the commands promise. The
Kafka load's trial also drives Gym 0.7.0's store (the public wheel, cached by the tests' loader).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench import apply_rate_ab, kafka_ab, producer_sends

_REPO = Path(__file__).resolve().parents[2]
_ORDER = ["trial 1 this", "trial 1 baseline", "trial 2 baseline", "trial 2 this"]


def _trials(out: str) -> list[str]:
    return [line.split(":")[0] for line in out.splitlines() if line.startswith("trial")]


def _small_load_trials(
    command: Callable[[list[str]], int], bootstrap: str, directory: Path, capsys: pytest.CaptureFixture[str]
) -> str:
    """Run a load A/B command on 2 rollouts, 2 trials per tree; check the order and that nothing is left behind."""
    argv = ["--baseline", str(_REPO), "--bootstrap", bootstrap, "--trials", "2", "--rollouts", "2"]
    assert command([*argv, "--dir", str(directory)]) == 0
    out = capsys.readouterr().out
    assert _trials(out) == _ORDER
    assert list(directory.iterdir()) == [], "trial directories are removed after the last trial"
    return out


def test_the_kafka_ab_command_alternates_the_trees_and_prints_their_medians(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _small_load_trials(kafka_ab.main, kafka_bootstrap, tmp_path, capsys)
    for figure in ("puts_per_s", "vs_gym", "freeze_p50_ms", "freeze_p99_ms", "replay_per_s", "backlog"):
        assert any(line.startswith(figure) for line in out.splitlines()), figure


def test_the_producer_sends_command_alternates_the_trees_and_prints_their_medians(
    kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--baseline", str(_REPO), "--bootstrap", kafka_bootstrap, "--trials", "2", "--senders", "2"]
    assert producer_sends.main([*argv, "--sends", "5"]) == 0
    out = capsys.readouterr().out
    assert _trials(out) == _ORDER
    for figure in ("sends_per_s", "cpu_us_per_send", "p50_ms", "p99_ms"):
        assert any(line.startswith(figure) for line in out.splitlines()), figure


def test_the_apply_rate_command_applies_every_event_of_each_trees_topic(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _small_load_trials(apply_rate_ab.main, kafka_bootstrap, tmp_path, capsys)
    # 2 slots x 2 rounds of rollouts, each 8 intents, 8 puts and a freeze: 68 events in every trial.
    for line in out.splitlines():
        if line.startswith("trial"):
            assert " events 68.00" in line, line
    medians = {line.split()[0]: line.split()[1:] for line in out.splitlines()[-4:]}
    assert medians["events"] == ["68.00", "68.00"]
    assert all(float(value) > 0 for value in medians["us_per_put"]), medians


@pytest.mark.parametrize("command", [kafka_ab.main, producer_sends.main, apply_rate_ab.main])
def test_a_baseline_that_is_not_a_checkout_is_refused(
    command: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert callable(command)
    assert command(["--baseline", str(tmp_path), "--bootstrap", "127.0.0.1:1"]) == 2
    assert "no transports/kafka/" in capsys.readouterr().out

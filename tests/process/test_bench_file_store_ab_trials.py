"""``python -m bench --only file_store_ab`` runs both trees in alternation and prints every trial and the medians.

It drives Gym 0.7.0's store (the public wheel, cached by the tests' loader) and tokcap's file store on a small
shape, each trial in a process of its own; no figure is checked, only that each tree ran, in the order the
harness promises, and that the results file holds both trees' medians and their ratio.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.__main__ import main

_REPO = Path(__file__).resolve().parents[2]


def test_the_ab_scenario_alternates_the_trees_and_prints_their_medians_and_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "latest.json"
    work = tmp_path / "work"
    argv = ["--only", "file_store_ab", "--baseline", str(_REPO), "--trials", "2", "--rollouts", "2"]
    assert main([*argv, "--dir", str(work), "--output", str(output)]) == 0
    lines = capsys.readouterr().out.splitlines()
    trials = [line.split(":")[0] for line in lines if line.startswith("trial")]
    assert trials == ["trial 1 this", "trial 1 baseline", "trial 2 baseline", "trial 2 this"]
    assert "medians of 2 trials:" in lines
    for figure in ("puts_per_s", "vs_gym", "freeze_p50_ms", "freeze_p99_ms", "puts_per_sync", "cpu_s"):
        assert any(line.startswith(figure) for line in lines), figure
    assert list(work.iterdir()) == [], "trial directories are removed after the last trial"
    results = orjson.loads(output.read_bytes())
    assert results["command"].startswith("python -m bench --only file_store_ab")
    measured = results["file_store_ab"]
    assert set(measured["medians"]) == {"this", "baseline"}
    assert measured["ratios"]["baseline"]["puts_per_s"] == 1.0


def test_the_file_floor_scenario_puts_the_floor_beside_gym_tokcap_and_the_load_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output, work = tmp_path / "latest.json", tmp_path / "work"
    argv = ["--only", "file_floor", "--trials", "1", "--rollouts", "2", "--no-kafka"]
    assert main([*argv, "--dir", str(work), "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert "medians of 1 trials:" in out
    measured = orjson.loads(output.read_bytes())["file_floor"]
    assert set(measured["medians"]) == {"floor", "gym", "file", "hop"}
    assert measured["ratios"]["gym"]["puts_per_s"] == 1.0
    assert measured["medians"]["file"]["cpu_us_per_put"] > 0
    assert list(work.iterdir()) == [], "trial directories are removed after the last trial"

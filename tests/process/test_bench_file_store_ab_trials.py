"""The file-store A/B command runs both trees in alternation and prints every trial and the medians.

It drives Gym 0.7.0's store (the public wheel, cached by the tests' loader) and tokcap's file store on a small
shape, each trial in a process of its own; no figure is checked, only that each tree ran, in the order the
command promises.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.file_store_ab import main

_REPO = Path(__file__).resolve().parents[2]


def test_the_ab_command_alternates_the_trees_and_prints_their_medians(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--baseline", str(_REPO), "--trials", "2", "--rollouts", "2", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    trials = [line.split(":")[0] for line in lines if line.startswith("trial")]
    assert trials == ["trial 1 this", "trial 1 baseline", "trial 2 baseline", "trial 2 this"]
    assert "medians of 2 trials:" in lines
    for figure in ("puts_per_s", "vs_gym", "freeze_p50_ms", "freeze_p99_ms", "puts_per_sync", "cpu_s"):
        assert any(line.startswith(figure) for line in lines), figure
    assert list(tmp_path.iterdir()) == [], "trial directories are removed after the last trial"

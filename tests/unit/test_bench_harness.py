"""The benchmark harness: variants take turns, each trial in a fresh directory, medians and ratios side by side.

The variants here are coroutines that record what they were given; no benchmark runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest

from bench.__main__ import parse_options
from bench.harness import Variant, alternate, machine_description, machine_line
from bench.options import BenchOptions
from bench.suite import BaselineMissingError, run_suite


def _recording(name: str, seen: list[tuple[str, Path]], figures: list[float]) -> Variant:
    values = iter(figures)

    async def trial(directory: Path) -> Mapping[str, float]:
        assert directory.is_dir() and not any(directory.iterdir()), "each trial starts in a fresh directory"
        (directory / "written").write_text(name)
        seen.append((name, directory))
        return {"rate": next(values)}

    return trial


def test_variants_take_turns_in_reversed_order_each_trial_and_their_directories_go_after_the_last(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, Path]] = []
    variants = {
        "this": _recording("this", seen, [1, 2, 9]),
        "baseline": _recording("baseline", seen, [4, 4, 4]),
    }
    lines: list[str] = []
    trials = asyncio.run(alternate(variants, 3, tmp_path, lines.append, shown=("rate",)))
    assert [name for name, _ in seen] == ["this", "baseline", "baseline", "this", "this", "baseline"]
    assert len({directory for _, directory in seen}) == 6
    assert lines[0] == "trial 1 this: rate 1.00" and lines[1] == "trial 1 baseline: rate 4.00"
    assert list(tmp_path.iterdir()) == [], "trial directories are removed after the last trial"
    assert trials.summary() == {"this": {"rate": 2.0}, "baseline": {"rate": 4.0}}
    assert trials.ratios("baseline") == {"this": {"rate": 0.5}, "baseline": {"rate": 1.0}}
    table = trials.table(("rate",), "baseline").splitlines()
    assert table[0] == "medians of 3 trials:"
    assert table[-1].split() == ["rate", "2.00", "4.00", "0.50"]


def test_a_failing_trial_still_removes_every_trial_directory(tmp_path: Path) -> None:
    async def fails(directory: Path) -> Mapping[str, float]:
        (directory / "left").write_text("x")
        raise RuntimeError("trial failed")

    with pytest.raises(RuntimeError, match="trial failed"):
        asyncio.run(alternate({"only": fails}, 2, tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_the_machine_line_names_cores_cpu_python_and_the_filesystem_of_the_directory(tmp_path: Path) -> None:
    machine = machine_description(tmp_path)
    line = machine_line(machine)
    assert f"{machine['cores']} cores" in line and f"Python {machine['python']}" in line
    assert machine["filesystem"] != "unknown" and machine["filesystem"] in line


def test_a_scenario_that_compares_two_checkouts_is_refused_without_a_baseline() -> None:
    with pytest.raises(SystemExit):
        parse_options(["--only", "file_store_ab"])


def test_a_baseline_that_is_not_a_checkout_is_refused_before_any_trial_runs(tmp_path: Path) -> None:
    options = BenchOptions(only=("file_store_ab",), baseline=tmp_path, work_dir=tmp_path / "work")
    with pytest.raises(BaselineMissingError, match="holding tokcap/"):
        run_suite(options, None, lambda _: None)
    assert list((tmp_path / "work").iterdir()) == []


def test_an_unknown_scenario_is_refused_with_the_names_that_exist() -> None:
    with pytest.raises(SystemExit):
        parse_options(["--only", "no_such_scenario"])

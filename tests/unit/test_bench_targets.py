"""The benchmark's targets are data: every row reads the right figure of one run and is judged by its comparator.

The results are made up (no benchmark runs here): the tests check the target table and the report code, not any
speed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from bench.growth import corner_figures
from bench.markdown import (
    README_END,
    README_START,
    render_markdown,
    render_scenarios,
    render_targets,
    update_readme,
)
from bench.targets import TARGETS, Target, evaluate


def _growth(turns: int, prompt: int, **figures: float) -> dict[str, Any]:
    base = {
        "wire_vs_new_tokens_wire_on": 1.1,
        "store_vs_new_tokens_json_records_on": 1.05,
        "file_puts_per_s_records_on": 1000.0,
        "kafka_puts_per_s_records_on": 800.0,
        "kafka_freeze_p99_ms_records_on": 90.0,
        "replay_entries_per_s_records_on": 500.0,
    }
    base.update(figures)
    return {
        "shape": {
            "turns": turns,
            "prompt_tokens": prompt,
            "label": f"{turns} turns, {prompt // 1000}k prompt",
        },
        "figures": base,
    }


def _grid() -> list[dict[str, Any]]:
    return [
        _growth(4, 1000, kafka_puts_per_s_records_on=1000.0),
        _growth(64, 1000),
        _growth(4, 32000, wire_vs_new_tokens_wire_on=1.0),
        _growth(64, 32000, kafka_puts_per_s_records_on=400.0, wire_vs_new_tokens_wire_on=1.2),
    ]


def _results() -> dict[str, Any]:
    """A full run's results with every figure the target tables read."""
    return {
        "started_at": "2026-12-01T00:00:00Z",
        "duration_s": 1.0,
        "machine": {"cpu": "cpu", "cores": 2, "memory_gb": 1.0, "python": "3.11", "filesystem": "ext4"},
        "command": "python -m bench --only main,batch,workers,growth,resolve",
        "options": {"repeats": 3, "growth_rollouts": 8, "shape": {"rounds": 2}},
        "main": {
            "shape": {
                "rollouts": 64,
                "rounds": 2,
                "turns": 8,
                "label": "8 turns, 1k prompt",
                "generated_tokens": 200,
                "tool_tokens": 100,
            },
            "figures": {
                "gym_puts_per_s": 100.0,
                "file_puts_per_s": 800.0,
                "kafka_puts_per_s": 600.0,
                "kafka_freeze_p99_ms": 40.0,
                "kafka_ext_freeze_p99_ms": 90.0,
                "file_freeze_p99_ms": 12.0,
                "file_put_cpu_us": 250.0,
                "apply_cpu_us_per_event": 70.0,
                "ratios": {
                    "file_puts_vs_gym": 8.0,
                    "kafka_puts_vs_gym": 6.0,
                    "replay_vs_orjson": 0.6,
                    "replay_workers_vs_orjson": 0.55,
                },
            },
        },
        "batch": {
            "shape": {"rollouts": 200, "turns": 4, "concurrency": 32},
            "repeats": 3,
            "targets": {
                name: {
                    "puts_per_s": 1.0,
                    "freezes_per_s": 1.0,
                    "puts_vs_gym": ratio,
                    "freezes_vs_gym": ratio,
                    "batch_freeze_ms": 1.0,
                }
                for name, ratio in (("gym", 1.0), ("file", 7.5), ("kafka", 2.5))
            },
        },
        "workers": {
            "rollouts": 1000,
            "turns": 8,
            "partitions": 4,
            "trials": 2,
            "figures": {
                "1": {
                    "events_per_s": 1000.0,
                    "events_per_s_per_worker": 1000.0,
                    "cpu_s_per_event": 1e-4,
                    "vs_first": 1.0,
                },
                "2": {
                    "events_per_s": 1800.0,
                    "events_per_s_per_worker": 900.0,
                    "cpu_s_per_event": 1e-4,
                    "vs_first": 1.8,
                },
            },
        },
        "growth": {"shapes": _grid()},
        "growth_corners": corner_figures(_grid()),
        "resolve": {
            "figures": {
                "resolves": 448,
                "kafka_p50_ms": 1.0,
                "kafka_p99_ms": 30.0,
                "kafka_max_ms": 40.0,
                "probe_resolves": 900,
                "probe_p50_ms": 2.0,
                "probe_p99_ms": 15.0,
                "probe_max_ms": 25.0,
            }
        },
    }


def _row(results: dict[str, Any], starts: str) -> dict[str, Any]:
    rows = [row for row in evaluate(results) if row["target"].startswith(starts)]
    assert len(rows) == 1, rows
    return rows[0]


def test_a_run_of_every_default_scenario_gives_each_of_their_targets_a_value() -> None:
    checked = evaluate(_results())
    staging = [target for target in TARGETS if target.scenario == "staging"]
    assert len(checked) == len(TARGETS) - len(staging)
    assert all(row["value"] is not None and row["met"] is not None for row in checked), [
        row["target"] for row in checked if row["value"] is None
    ]


def test_every_target_names_a_known_comparator_and_anchor_and_a_scenario_that_exists() -> None:
    from bench.scenarios import SCENARIOS
    from bench.targets import ANCHORS

    names = {scenario.name for scenario in SCENARIOS}
    for target in TARGETS:
        assert target.comparator in ("<", "<=", ">=", ">"), target
        assert target.anchor is None or target.anchor in ANCHORS, target
        assert target.scenario in names, target


@pytest.mark.parametrize(
    ("comparator", "value", "met"),
    [("<", 9.9, True), ("<", 10.0, False), ("<=", 10.0, True), (">=", 10.0, True), (">", 10.0, False)],
)
def test_a_target_is_met_exactly_as_its_comparator_says(comparator: str, value: float, met: bool) -> None:
    assert Target("x", "main.figures.x", comparator, 10.0).met(value) is met


def test_each_target_is_judged_against_its_goal() -> None:
    results = _results()
    assert _row(results, "Kafka freeze p99 under the main load, materializer in process")["met"] is True
    assert _row(results, "file-store freeze p99")["met"] is False  # 12 >= 10
    assert _row(results, "Kafka put/s ÷ Gym, main")["met"] is True  # 6 >= 4
    assert _row(results, "CPU per file-store put")["met"] is False  # 250 > 200
    assert _row(results, "materializer apply")["met"] is True  # 1.8 >= 1.7
    assert _row(results, "Kafka resolve p99")["met"] is True  # the probe's 15 < 20
    results["resolve"]["figures"]["probe_p99_ms"] = 30.0
    assert _row(results, "Kafka resolve p99")["met"] is False


def test_growth_targets_compare_the_largest_shape_with_the_smallest_and_with_its_fewest_turns() -> None:
    results = _results()
    puts = _row(results, "Kafka put/s, largest")
    assert puts["value"] == 400.0 / 1000.0 and puts["met"] is False
    wire = _row(results, "wire B/call")
    assert wire["value"] == 1.2 and wire["met"] is True
    flat = next(row for row in evaluate(results) if "flat" in row["target"])
    assert flat["value"] == 1.2 / 1.0 and flat["met"] is False


def test_a_run_without_a_scenario_leaves_out_its_targets_instead_of_failing() -> None:
    results = _results()
    del results["workers"], results["growth"], results["growth_corners"]
    targets = [row["target"] for row in evaluate(results)]
    assert not any(name.startswith("materializer apply") for name in targets)
    assert not any("largest" in name for name in targets)
    results = _results()
    del results["main"]["figures"]["apply_cpu_us_per_event"]
    row = _row(results, "apply step CPU")
    assert row["value"] is None and row["met"] is None


def test_the_readme_section_is_replaced_with_every_table_the_command_and_misses_in_bold(
    tmp_path: Any,
) -> None:
    readme = tmp_path / "README.md"
    sections = "".join(
        f"<!-- {name}:start -->\nold {name}\n<!-- {name}:end -->\n"
        for name in ("bench-scenarios", "bench-targets")
    )
    readme.write_text(f"before\n{sections}{README_START}\nold figures\n{README_END}\nafter\n")
    update_readme(readme, copy.deepcopy(_results()))
    text = readme.read_text()
    assert "old " not in text and text.startswith("before\n") and text.endswith("after\n")
    assert render_scenarios() in text and render_targets() in text
    for title in ("Main load", "Batch freeze", "Materializer workers", "Growth grid", "Lineage resolve"):
        assert title in text
    assert "`python -m bench --only main,batch,workers,growth,resolve`" in text
    assert "Targets (measured in this run)" in text and "issue" not in text.lower()
    assert "| **no** |" in text and "| yes |" in text
    assert render_markdown(_results()) in text


def test_a_grid_of_one_shape_leaves_the_growth_comparisons_unmeasured() -> None:
    results = _results()
    results["growth"] = {"shapes": _grid()[-1:]}
    results["growth_corners"] = corner_figures(_grid()[-1:])
    assert _row(results, "Kafka put/s, largest")["value"] is None
    assert _row(results, "wire B/call")["value"] == 1.2


def test_the_readme_shows_the_scenario_and_target_tables_exactly_as_their_data_says() -> None:
    readme = (Path(__file__).resolve().parents[2] / "bench" / "README.md").read_text()
    assert f"<!-- bench-scenarios:start -->\n{render_scenarios()}\n<!-- bench-scenarios:end -->" in readme
    assert f"<!-- bench-targets:start -->\n{render_targets()}\n<!-- bench-targets:end -->" in readme

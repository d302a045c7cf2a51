"""The benchmark's target tables: every row of issues 12 and 14 is read from the right figure of one run.

The results are made up (no benchmark runs here): the tests check the report code, not any speed.
"""

from __future__ import annotations

import copy
from typing import Any

from bench.markdown import README_END, README_START, render_markdown, update_readme
from bench.report import evaluate_targets


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


def _results() -> dict[str, Any]:
    """A full run's results with every figure the target tables read."""
    return {
        "started_at": "2026-12-01T00:00:00Z",
        "duration_s": 1.0,
        "machine": {"cpu": "cpu", "cores": 2, "memory_gb": 1.0, "python": "3.11", "filesystem": "ext4"},
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
                "file_freeze_p99_ms": 12.0,
                "ratios": {"file_puts_vs_gym": 8.0, "kafka_puts_vs_gym": 6.0, "replay_vs_orjson": 0.6},
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
        "growth": [
            _growth(4, 1000, kafka_puts_per_s_records_on=1000.0),
            _growth(64, 1000),
            _growth(4, 32000, wire_vs_new_tokens_wire_on=1.0),
            _growth(64, 32000, kafka_puts_per_s_records_on=400.0, wire_vs_new_tokens_wire_on=1.2),
        ],
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


def _row(results: dict[str, Any], issue: str, starts: str) -> dict[str, Any]:
    rows = [row for row in evaluate_targets(results)[issue] if row["target"].startswith(starts)]
    assert len(rows) == 1, rows
    return rows[0]


def test_a_full_run_gives_every_target_row_of_both_issues_a_value() -> None:
    checked = evaluate_targets(_results())
    assert set(checked) == {"issue 12", "issue 14"}
    assert len(checked["issue 14"]) == 9 and len(checked["issue 12"]) == 9
    assert all(
        row["value"] is not None and row["met"] is not None for rows in checked.values() for row in rows
    )


def test_each_target_is_judged_against_its_goal() -> None:
    results = _results()
    assert _row(results, "issue 14", "Kafka freeze p99")["met"] is True  # 40 < 50
    assert _row(results, "issue 14", "file-store freeze p99")["met"] is False  # 12 >= 10
    assert _row(results, "issue 14", "Kafka put/s ÷ Gym, main")["met"] is False  # 6 < 7
    assert _row(results, "issue 14", "materializer apply")["met"] is True  # 1.8 >= 1.7
    assert _row(results, "issue 12", "Kafka resolve p99")["met"] is True  # the probe's 15 < 20
    results["resolve"]["figures"]["probe_p99_ms"] = 30.0
    assert _row(results, "issue 12", "Kafka resolve p99")["met"] is False


def test_growth_targets_compare_the_largest_shape_with_the_smallest_and_with_its_fewest_turns() -> None:
    results = _results()
    puts = _row(results, "issue 12", "Kafka put/s, largest")
    assert puts["value"] == 400.0 / 1000.0 and puts["met"] is False
    wire = _row(results, "issue 12", "wire B/call")
    assert wire["value"] == 1.2 and wire["met"] is True
    flat = next(row for row in evaluate_targets(results)["issue 12"] if "flat" in row["target"])
    assert flat["value"] == 1.2 / 1.0 and flat["met"] is False


def test_a_run_without_a_section_leaves_its_targets_unmeasured_instead_of_failing() -> None:
    results = _results()
    del results["workers"], results["growth"]
    row = _row(results, "issue 14", "materializer apply")
    assert row["value"] is None and row["met"] is None
    assert all(row["value"] is None for row in evaluate_targets(results)["issue 12"][:-1])


def test_the_readme_section_is_replaced_with_every_table_and_misses_in_bold(tmp_path: Any) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{README_START}\nold figures\n{README_END}\nafter\n")
    update_readme(readme, copy.deepcopy(_results()))
    text = readme.read_text()
    assert "old figures" not in text and text.startswith("before\n") and text.endswith("after\n")
    for title in ("Main load", "Batch freeze", "Materializer workers", "Growth grid", "Lineage resolve"):
        assert title in text
    assert "Targets of issue 14" in text and "Targets of issue 12" in text
    assert "| **no** |" in text and "| yes |" in text
    assert render_markdown(_results()) in text


def test_a_grid_of_one_shape_leaves_the_growth_comparisons_unmeasured() -> None:
    results = _results()
    results["growth"] = results["growth"][-1:]
    assert _row(results, "issue 12", "Kafka put/s, largest")["value"] is None
    assert _row(results, "issue 12", "wire B/call")["value"] == 1.2

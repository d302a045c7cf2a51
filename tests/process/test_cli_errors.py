"""Every mistake a user can make gives one line on stderr and a non-zero exit status, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import Completed, tokcap

from tokcap.files.store import TokenCaptureStore


def assert_one_line_error(completed: Completed, expected_status: int, fragment: str) -> None:
    assert completed.returncode == expected_status
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith("tokcap: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in completed.stderr


def test_inspecting_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(tokcap("inspect", str(tmp_path / "absent")), 1, "does not exist")


def test_inspecting_a_file_instead_of_a_directory_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    assert_one_line_error(tokcap("inspect", str(path)), 1, "is not a directory")


def test_a_rollout_id_that_could_escape_the_store_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(tokcap("inspect", str(tmp_path), "../etc"), 1, "is not allowed")


def test_an_unknown_rollout_is_one_line(tmp_path: Path) -> None:
    TokenCaptureStore(tmp_path).begin_call_now("known", "c1")
    assert_one_line_error(tokcap("inspect", str(tmp_path), "unknown"), 1, "has no files")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("demo", "--rollouts", "0"), "--rollouts must be at least 1"),
        (("demo", "--turns", "-1"), "--turns must be at least 1"),
    ],
)
def test_impossible_demo_sizes_are_one_line(args: tuple[str, ...], fragment: str) -> None:
    assert_one_line_error(tokcap(*args), 1, fragment)


def test_the_demo_refuses_a_directory_that_already_has_files(tmp_path: Path) -> None:
    (tmp_path / "leftover").write_text("x")
    assert_one_line_error(tokcap("demo", "--dir", str(tmp_path)), 1, "is not empty")


def test_an_unknown_option_is_a_usage_error_on_one_line() -> None:
    assert_one_line_error(tokcap("demo", "--no-such-option"), 2, "--no-such-option")


def test_an_unknown_command_is_a_usage_error_on_one_line() -> None:
    assert_one_line_error(tokcap("demoo"), 2, "demoo")


def test_a_missing_required_option_is_a_usage_error_on_one_line(tmp_path: Path) -> None:
    assert_one_line_error(tokcap("replay", "--bootstrap", "localhost:1", "--run", "r"), 2, "--dir")


def test_a_kafka_command_needs_a_run_or_a_topic(tmp_path: Path) -> None:
    assert_one_line_error(
        tokcap("replay", "--bootstrap", "localhost:1", "--dir", str(tmp_path / "new")), 1, "--run"
    )


def test_a_run_id_kafka_cannot_name_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(
        tokcap("log", "--bootstrap", "localhost:1", "--run", "bad run", "--rollout", "r1"), 1, "cannot name"
    )


@pytest.mark.parametrize(
    ("args", "status", "fragment"),
    [
        (("--workers", "0"), 2, "Invalid value for '--workers'"),
        (("--partitions", "3-1"), 1, "has the range '3-1' running backwards"),
    ],
)
def test_impossible_materialize_workers_and_partitions_are_one_line(
    tmp_path: Path, args: tuple[str, ...], status: int, fragment: str
) -> None:
    command = ("materialize", "--bootstrap", "localhost:1", "--run", "r", "--dir", str(tmp_path / "d"))
    assert_one_line_error(tokcap(*command, *args), status, fragment)

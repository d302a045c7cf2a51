"""Failures inside a command become one ``tokcap: error:`` line and the exit status a script can act on."""

from __future__ import annotations

import errno
import io
from collections.abc import Callable

import pytest
import typer
from pydantic import BaseModel, ValidationError

from tokcap.cli.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    one_line,
    report_failure,
    run_reporting_failures,
)
from tokcap.errors import InvalidRolloutIdError


class _Port(BaseModel):
    port: int


def _validation_error() -> ValidationError:
    try:
        _Port.model_validate({"port": "not a number"})
    except ValidationError as exc:
        return exc
    raise AssertionError("the model accepted a non-number")


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (
            FileNotFoundError(errno.ENOENT, "No such file", "/data/run"),
            "/data/run: no such file or directory",
        ),
        (PermissionError(errno.EACCES, "Permission denied", "/data/run"), "/data/run: permission denied"),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/data/run"), "/data/run: not a directory"),
        (OSError(errno.ENOSPC, "No space left on device", "/data/run"), "No space left on device: /data/run"),
        (OSError(errno.EIO, "Input/output error"), "Input/output error"),
        (
            InvalidRolloutIdError("rollout id '../x' may not contain '/'\nrename it"),
            "rollout id '../x' may not",
        ),
    ],
)
def test_a_failure_of_the_work_is_one_line_naming_the_file_and_exits_1(exc: Exception, line: str) -> None:
    out = io.StringIO()
    assert report_failure(exc, out) == EXIT_FAILURE
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokcap: error: ") and line in lines[0]


def test_an_invalid_value_names_what_was_wrong_on_one_line() -> None:
    out = io.StringIO()
    assert report_failure(_validation_error(), out) == EXIT_FAILURE
    assert out.getvalue().startswith("tokcap: error: invalid value: Input should be a valid integer")


def test_an_empty_message_still_prints_something() -> None:
    assert one_line(" \n\t") == "unknown error"
    assert one_line("two\n  lines") == "two lines"


def _raising(exc: BaseException) -> Callable[[], object]:
    def command() -> object:
        raise exc

    return command


@pytest.mark.parametrize(
    ("exc", "status", "stderr"),
    [
        (KeyboardInterrupt(), EXIT_INTERRUPTED, "tokcap: interrupted\n"),
        (typer.Abort(), EXIT_FAILURE, "tokcap: aborted\n"),
        (typer.Exit(code=EXIT_USAGE), EXIT_USAGE, ""),
        (OSError(errno.EIO, "Input/output error"), EXIT_FAILURE, "tokcap: error: Input/output error\n"),
    ],
)
def test_interrupts_aborts_and_exits_map_to_their_status(
    exc: BaseException, status: int, stderr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_reporting_failures(_raising(exc)) == status
    assert capsys.readouterr().err == stderr


def test_a_command_returning_a_status_passes_it_through_and_anything_else_is_success() -> None:
    assert run_reporting_failures(lambda: 3) == 3
    assert run_reporting_failures(lambda: None) == 0


def test_a_missing_kafka_client_says_which_extra_to_install() -> None:
    stream = io.StringIO()
    status = report_failure(
        ModuleNotFoundError("No module named 'confluent_kafka'", name="confluent_kafka"), stream
    )
    assert status == 1
    assert stream.getvalue().count("\n") == 1
    assert "pip install 'tokcap[kafka]'" in stream.getvalue()


def test_an_unexpected_error_is_still_one_line_and_points_at_the_debug_switch() -> None:
    stream = io.StringIO()
    status = report_failure(ZeroDivisionError("division by zero\nwith a second line"), stream)
    assert status == 1
    assert stream.getvalue().count("\n") == 1
    assert "TOKCAP_DEBUG=1" in stream.getvalue()

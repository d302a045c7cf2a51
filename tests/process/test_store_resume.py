"""A projection killed at any event boundary of a block, or in its flush, resumes to a clean replay's bytes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from resume_history import BLOCKS, apply_blocks
from store_contract import directory_contents

from tokcap.files.log_projection import Projection
from tokcap.files.store import TokenCaptureStore

_TESTS = Path(__file__).resolve().parents[1]
_MOST_ROLLOUTS_IN_A_BLOCK = 3


def _without_locks(root: Path) -> dict[str, bytes]:
    return {name: data for name, data in directory_contents(root).items() if not name.endswith(".lock")}


@pytest.fixture(scope="module")
def clean_replay(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, bytes]]:
    """The directory a clean replay leaves after each block."""
    root = tmp_path_factory.mktemp("clean")
    projection = Projection(TokenCaptureStore(root))
    after_each_block = []
    for block in range(len(BLOCKS)):
        apply_blocks(projection, block, block + 1)
        after_each_block.append(_without_locks(root))
    return after_each_block


@pytest.fixture(scope="module")
def killer() -> Iterator[subprocess.Popen[str]]:
    """A warm process that forks one applier per kill point."""
    server = subprocess.Popen(
        [sys.executable, str(_TESTS / "resume_history.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=_TESTS,
        env={"PYTHONPATH": f"{_TESTS}:{_TESTS.parent}", "PATH": "/usr/bin:/bin"},
    )
    yield server
    assert server.stdin is not None and server.stdout is not None
    server.stdin.close()
    server.wait(timeout=30)
    server.stdout.close()


def _kill_points() -> list[tuple[int, int, int]]:
    points = []
    for block, events in enumerate(BLOCKS):
        points += [(block, boundary, -1) for boundary in range(len(events) + 1)]
        points += [(block, len(events), writes) for writes in range(_MOST_ROLLOUTS_IN_A_BLOCK + 1)]
    return points


@pytest.mark.parametrize(("block", "boundary", "closing_writes"), _kill_points())
def test_a_projection_killed_at_any_boundary_resumes_to_the_bytes_of_a_clean_replay(
    block: int,
    boundary: int,
    closing_writes: int,
    clean_replay: list[dict[str, bytes]],
    killer: subprocess.Popen[str],
    tmp_path: Path,
) -> None:
    assert killer.stdin is not None and killer.stdout is not None
    killer.stdin.write(f"{tmp_path} {block} {boundary} {closing_writes}\n")
    killer.stdin.flush()
    assert killer.stdout.readline().strip() == "signal 9"
    resumed = Projection(TokenCaptureStore(tmp_path))
    apply_blocks(resumed, block, block + 1)
    assert _without_locks(tmp_path) == clean_replay[block]
    apply_blocks(resumed, block + 1)
    assert _without_locks(tmp_path) == clean_replay[-1]

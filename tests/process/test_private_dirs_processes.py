"""Private directories across processes: a killed owner's directory is removed by the next start, a live
owner's is kept, and one a process never released is removed when it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tokcap.files.private_dirs import PrivateDirectories

REPO = Path(__file__).resolve().parents[2]


def _entries(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir())


def _child(root: Path, then: str) -> subprocess.Popen[str]:
    """A process that takes a private directory under ``root``, prints it, then does ``then``."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from tokcap.files.private_dirs import PrivateDirectories
        directories = PrivateDirectories(Path({str(root)!r}))
        path = directories.acquire("ledger-run", "key")
        (path / "projection-file").write_bytes(b"x" * 1000)
        print(path, flush=True)
        {then}
        """
    )
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def _first_line(child: subprocess.Popen[str]) -> Path:
    assert child.stdout is not None
    return Path(child.stdout.readline().strip())


def _ended(child: subprocess.Popen[str]) -> int:
    child.communicate()
    return child.returncode


def test_a_directory_left_by_a_killed_process_is_removed_by_the_next_start(tmp_path: Path) -> None:
    child = _child(tmp_path, "time.sleep(60)")
    left = _first_line(child)
    child.send_signal(signal.SIGKILL)
    assert _ended(child) == -signal.SIGKILL
    assert left.is_dir() and (tmp_path / f"{left.name}.lock").exists()
    directories = PrivateDirectories(tmp_path)
    mine = directories.acquire("ledger-run", "key")
    assert _entries(tmp_path) == sorted([mine.name, f"{mine.name}.lock"])
    directories.release(mine)


def test_a_directory_whose_process_still_runs_is_kept(tmp_path: Path) -> None:
    child = _child(tmp_path, "sys.stdin.read()")
    try:
        theirs = _first_line(child)
        directories = PrivateDirectories(tmp_path)
        mine = directories.acquire("ledger-run", "key")
        assert theirs.is_dir() and (theirs / "projection-file").exists()
        directories.release(mine)
    finally:
        child.kill()
        _ended(child)


def test_a_process_that_exits_without_releasing_removes_its_directory_at_exit(tmp_path: Path) -> None:
    child = _child(tmp_path, "")
    left = _first_line(child)
    assert _ended(child) == 0
    assert not left.exists()
    assert _entries(tmp_path) == []

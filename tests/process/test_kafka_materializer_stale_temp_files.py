"""The materializer removes the temporary files a dead process left and keeps those of a live one.

A dead process is a real one: a child that ran and exited, so its pid is one the system has handed out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from transports.kafka.materializer import remove_stale_temp_files


def test_temporary_files_of_dead_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    dead_pid = int(finished.stdout)
    stale = tmp_path / f"r1.tokens.state.json.tmp-{dead_pid}-1"
    live = tmp_path / f"r1.tokens.state.json.tmp-{os.getpid()}-1"
    stale.write_bytes(b"x")
    live.write_bytes(b"y")
    assert remove_stale_temp_files(tmp_path) == [stale]
    assert live.exists() and not stale.exists()

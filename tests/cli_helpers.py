"""Running the real ``tokcap`` command in a subprocess, as a user's shell would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Completed:
    """Exit status and output of one ``tokcap`` run."""

    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def tokcap(*args: str, timeout: float = 300.0) -> Completed:
    """Run ``python -m tokcap.cli ARGS`` with the test interpreter; never raises on a non-zero exit."""
    env = {key: value for key, value in os.environ.items() if key != "TOKCAP_DEBUG"}
    completed = subprocess.run(
        [sys.executable, "-m", "tokcap.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )
    return Completed(completed.returncode, completed.stdout, completed.stderr)

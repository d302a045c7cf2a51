"""A materializer's own process leaves its start-up heap out of collections and collects young objects less often."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import gc
from transports.kafka import materializer
before = gc.get_threshold()
materializer.collect_less_after_start_up()
print(gc.get_freeze_count() > 0, gc.get_threshold()[0] > before[0] * 10, gc.get_threshold()[1:] == before[1:])
"""


def test_a_materializer_process_freezes_its_start_up_heap_and_runs_young_passes_less_often() -> None:
    # In a child process: the collector's settings are the whole process's, and this one is pytest's.
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "True", "True"]

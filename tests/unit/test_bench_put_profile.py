"""The put profiler's steps add up to the put it timed, and the functions it timed are left as they were.

``python -m bench.put_profile`` gives the table of ``docs/performance.md``'s "Where a file-store put's CPU goes";
no speed is checked here.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import tokcap.events
import tokcap.store
from bench.put_profile import profile_puts


def test_the_steps_sum_to_the_timed_put_and_name_the_work_every_put_does(tmp_path: Path) -> None:
    result = profile_puts(tmp_path, rollouts=1, trials=1)
    assert len(result.plain_us) == len(result.timed_us) == 1
    assert sum(result.steps_us.values()) == pytest.approx(result.timed_us[0], rel=1e-9)
    for step in (
        "input validation (accept_entry: token id range, finite floats, ids)",
        "canonical JSON encode (orjson)",
        "payload digest (sha256 of the line)",
        "line write (open, fstat, write, close)",
        "filesystem sync (syncfs, kernel CPU included)",
    ):
        assert result.steps_us[step] > 0, step


def test_the_profiler_puts_every_function_it_timed_back(tmp_path: Path) -> None:
    accept_entry = tokcap.store.accept_entry
    apply = tokcap.store.TokenCaptureStore.__dict__["apply"]
    entry_line = tokcap.events.PutEvent.__dict__["entry_line"]
    assert isinstance(entry_line, functools.cached_property)
    computed = entry_line.func
    profile_puts(tmp_path, rollouts=1, trials=1)
    assert tokcap.store.accept_entry is accept_entry
    assert tokcap.store.TokenCaptureStore.__dict__["apply"] is apply
    assert entry_line.func is computed

"""The file-work floor writes exactly the lines tokcap stores, and the hop-only target runs every call on its thread.

``python -m bench --only file_floor`` puts both beside Gym's store and tokcap's (``tests/process``); no speed is
checked.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.file_floor import HopOnly, run_floor, run_hop_only
from bench.load import prepare
from bench.options import WorkloadShape


def test_the_floor_writes_every_entry_line_in_call_order_and_one_state_per_rollout(tmp_path: Path) -> None:
    workload = prepare(WorkloadShape(rollouts=2, rounds=2, turns=3, prompt_tokens=20), "floor-test")
    run = run_floor(workload, tmp_path, puts_per_sync=2)
    assert run.puts == workload.puts == 12
    for slot in workload.slots:
        for rollout_id, entries in slot:
            lines = (tmp_path / f"{rollout_id}.tokens.jsonl").read_bytes().splitlines(keepends=True)
            assert lines == [entry.canonical_json() + b"\n" for entry in entries]
            intents = (tmp_path / f"{rollout_id}.intents.jsonl").read_bytes().splitlines()
            assert len(intents) == len(entries)
            assert (tmp_path / f"{rollout_id}.state.json").is_file()
    assert not list(tmp_path.glob("*.tmp")), "every state file was renamed into place"
    assert run.puts_per_s > 0 and run.cpu_us_per_put > 0


def test_the_floor_refuses_a_sync_interval_below_one(tmp_path: Path) -> None:
    workload = prepare(WorkloadShape(rollouts=1, rounds=1, turns=1, prompt_tokens=4), "floor-test")
    with pytest.raises(ValueError, match="puts_per_sync must be 1 or more"):
        run_floor(workload, tmp_path, puts_per_sync=0)


def test_the_hop_only_target_runs_every_call_of_the_load_on_its_writer_thread() -> None:
    workload = prepare(WorkloadShape(rollouts=3, rounds=2, turns=2, prompt_tokens=8), "hop-test")
    target = HopOnly()
    assert asyncio.run(run_hop_only(workload, target)) > 0
    calls = 2 * workload.puts + workload.shape.total_rollouts
    assert target.ran_on == {"tokcap-bench-hop": calls}

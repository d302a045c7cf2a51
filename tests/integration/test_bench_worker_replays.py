"""The main load's Kafka trial replays its topic in worker processes too, and only into the same bytes.

Small shapes against a real broker; no speed is checked, only what each replay counted and that a replay by
workers which left another directory than the one-process replay is refused rather than reported.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench import kafka_trial
from bench.kafka_trial import run_kafka_trial
from bench.trials import _workload
from bench.workers import WorkersMismatchError

pytestmark = pytest.mark.kafka


def test_a_trial_replayed_in_workers_counts_every_event_of_its_partitions_in_each_replay(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    workload = _workload(2, "worker-replays")
    trial = asyncio.run(run_kafka_trial(workload, kafka_bootstrap, tmp_path, replay_in_workers=True))
    assert trial.one_worker_replay is not None and trial.parallel_replay is not None
    for replay in (trial.one_worker_replay, trial.parallel_replay):
        assert replay.events == trial.replay.events > 0
        assert replay.puts == workload.puts and replay.puts_per_s > 0
    plain = asyncio.run(run_kafka_trial(workload, kafka_bootstrap, tmp_path / "plain"))
    assert plain.one_worker_replay is None and plain.parallel_replay is None


def test_a_replay_by_workers_that_leaves_other_bytes_than_the_one_process_replay_is_refused(
    kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one_process_replay = kafka_trial._replay

    def replay_with_a_stray_file(*args: Any) -> Any:
        figures = one_process_replay(*args)
        (args[2] / "stray").write_bytes(b"not written by the workers")
        return figures

    monkeypatch.setattr(kafka_trial, "_replay", replay_with_a_stray_file)
    with pytest.raises(WorkersMismatchError, match="different from the one-process replay"):
        asyncio.run(
            run_kafka_trial(_workload(2, "worker-replays"), kafka_bootstrap, tmp_path, replay_in_workers=True)
        )

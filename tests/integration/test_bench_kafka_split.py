"""The split Kafka load: the sinks in the load's process, every freeze served by a trainer process.

Runs against a real broker and a real child process; no figure is checked, only that every rollout the load
finished was frozen by the trainer and checked, and that the trainer's failures reach the load.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from bench import trainer_first
from bench.kafka_split import TrainerProcessError, _start_trainer, run_with_trainer_process
from bench.load import prepare
from bench.options import WorkloadShape
from transports.kafka.topics import ensure_topic


def test_the_trainer_process_freezes_every_rollout_the_load_finished(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    workload = prepare(WorkloadShape(rollouts=3, rounds=2, turns=2, prompt_tokens=64), "split-test")
    trial = asyncio.run(run_with_trainer_process(workload, kafka_bootstrap, tmp_path))
    frozen = len(trial.trainer_freeze_under_load_ms) + len(trial.trainer_freeze_after_load_ms)
    assert frozen == 6
    assert trial.load.puts == workload.puts
    assert len(trial.load.freeze_under_load_ms) + len(trial.load.freeze_after_load_ms) == 6
    assert all(
        latency > 0 for latency in trial.trainer_freeze_under_load_ms + trial.trainer_freeze_after_load_ms
    )


def test_a_freeze_the_trainer_cannot_serve_fails_the_load_with_the_trainers_reason(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic = f"tokcap.test-split-{uuid.uuid4().hex[:8]}"
    ensure_topic(kafka_bootstrap, topic)

    async def freeze_a_bad_id() -> None:
        trainer = await _start_trainer(kafka_bootstrap, topic, tmp_path)
        try:
            with pytest.raises(TrainerProcessError, match="could not freeze"):
                await trainer.freeze("not a valid rollout id/..")
        finally:
            await trainer.close()

    asyncio.run(freeze_a_bad_id())


def test_the_trainer_first_command_lowers_only_the_load_process_priority_in_its_own_arm(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--bootstrap", kafka_bootstrap, "--trials", "2", "--rollouts", "2", "--nice", "7"]
    assert trainer_first.main([*argv, "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    trials = [line for line in lines if line.startswith("trial")]
    assert [line.split(":")[0] for line in trials] == [
        "trial 1 equal",
        "trial 1 trainer_first",
        "trial 2 trainer_first",
        "trial 2 equal",
    ]
    for line in trials:
        niceness = line.split("niceness ")[1]
        assert niceness == ("7.00" if "trainer_first" in line else "0.00"), line
    assert lines[-1].split() == ["niceness", "0.00", "7.00"]
    assert list(tmp_path.iterdir()) == [], "trial directories are removed after the last trial"


def test_the_trainer_first_command_refuses_a_priority_that_would_not_lower_the_load(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        trainer_first.main(["--bootstrap", "127.0.0.1:1", "--nice", "0"])
    assert "--nice must be 1 to 19" in capsys.readouterr().err

"""The split Kafka load: the sinks in the load's process, every freeze served by a trainer process.

Runs against a real broker and a real child process; no figure is checked, only that every rollout the load
finished was frozen by the trainer and checked, and that the trainer's failures reach the load.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import orjson
import pytest

from bench.__main__ import main
from bench.kafka_split import TrainerProcessError, _start_trainer, run_with_trainer_process
from bench.load import prepare
from bench.options import WorkloadShape
from bench.scenarios import by_name
from transports.kafka.client.topics import ensure_topic


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


def test_the_trainer_first_scenario_lowers_only_the_load_process_priority_in_its_own_variant(
    kafka_bootstrap: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--only", "trainer_first", "--bootstrap", kafka_bootstrap, "--trials", "2", "--rollouts", "2"]
    work, output = tmp_path / "work", tmp_path / "latest.json"
    assert main([*argv, "--dir", str(work), "--output", str(output)]) == 0
    lines = capsys.readouterr().out.splitlines()
    trials = [line for line in lines if line.startswith("trial")]
    assert [line.split(":")[0] for line in trials] == [
        "trial 1 equal",
        "trial 1 trainer_first",
        "trial 2 trainer_first",
        "trial 2 equal",
    ]
    nice = by_name("trainer_first").settings["trainer_first"]["nice"]
    for line in trials:
        niceness = line.split("niceness ")[1]
        assert niceness == (f"{nice:.2f}" if "trainer_first" in line else "0.00"), line
    medians = orjson.loads(output.read_bytes())["trainer_first"]["medians"]
    assert medians["equal"]["niceness"] == 0 and medians["trainer_first"]["niceness"] == nice
    assert list(work.iterdir()) == [], "trial directories are removed after the last trial"

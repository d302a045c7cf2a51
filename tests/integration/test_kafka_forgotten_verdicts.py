"""An in-process source whose answer the projection's memory does not hold reads it from flushed files only.

The projection answers a command by position from the rollout's state and entries while it keeps them, and
from the files once it let them go (only after they are written). Run once with memory and once with
nothing kept past a flush (so every answer memory can drop comes from the files), the same commands must get
the same verdicts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from store_contract import make_entry

from tokcap.errors import RolloutRetiredError
from tokcap.files.log_projection import Projection
from transports.kafka import KafkaTokenSink, KafkaTokenSource


async def verdicts_of_a_rollouts_commands(bootstrap: str, topic: str, store_dir: Path) -> list[object]:
    """Freezes, drops (stale and current), a freeze and a drop after retirement, deletes: what each answered."""
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    source = KafkaTokenSource(bootstrap_servers=bootstrap, topic=topic, store_dir=store_dir)
    verdicts: list[object] = []
    latest = {}
    try:
        for rollout in ("r1", "r2"):
            for call in range(3):
                await sink.put(make_entry(rollout, f"c{call}", tokens=20 + call))
            first = await source.freeze(rollout)
            verdicts.append([entry.model_call_id for entry in first.entries])
            verdicts.append(await source.freeze(rollout) == first)
            await sink.put(make_entry(rollout, "late"))
            verdicts.append(await source.drop(rollout, first.snapshot_id, first.version))
            latest[rollout] = second = await source.freeze(rollout)
            verdicts.append((second.version, len(second.entries), second.incomplete))
        verdicts.append(await source.drop("r1", latest["r1"].snapshot_id, latest["r1"].version))
        verdicts.append(await source.retire(["r2"]))
        with pytest.raises(RolloutRetiredError):
            await source.freeze("r2")
        verdicts.append(await source.delete(["r1", "r2"]))
        verdicts.append(await source.delete(["r1"]))
    finally:
        await sink.close()
        await source.close()
    return verdicts


def test_commands_whose_verdicts_were_forgotten_get_the_verdicts_memory_gives(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remembered = asyncio.run(
        verdicts_of_a_rollouts_commands(
            kafka_bootstrap, kafka_topic_factory("kept", partitions=2), tmp_path / "a"
        )
    )
    real_init = Projection.__init__

    def keeping_nothing(self: Projection, store: Any, **_: int) -> None:
        real_init(self, store, hot_tokens=0, hot_rollouts=0)

    monkeypatch.setattr(Projection, "__init__", keeping_nothing)
    forgotten = asyncio.run(
        verdicts_of_a_rollouts_commands(
            kafka_bootstrap, kafka_topic_factory("lost", partitions=2), tmp_path / "b"
        )
    )
    assert forgotten == remembered
    assert remembered[2] is False and remembered[8] is True

"""The split Kafka load checks each snapshot the trainer describes against the calls the load wrote."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from bench.kafka_split import _SplitTarget, _Trainer, _TrainerLatencies
from bench.load import BenchmarkCheckError
from tests.store_contract import make_entry


class _Sink:
    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        return None

    async def put(self, entry: Any) -> None:
        return None


class _DescribingTrainer:
    def __init__(self, call_ids: list[str]) -> None:
        self.call_ids = call_ids

    async def freeze(self, rollout_id: str) -> dict[str, Any]:
        return {
            "rollout_id": rollout_id,
            "model_call_ids": self.call_ids,
            "incomplete": False,
            "latency_ms": 1.5,
        }


def _target(call_ids: list[str], latencies: _TrainerLatencies) -> _SplitTarget:
    return _SplitTarget(cast(Any, _Sink()), cast(_Trainer, _DescribingTrainer(call_ids)), latencies)


async def _write_two_calls_and_freeze(target: _SplitTarget) -> Any:
    for call in ("call-a", "call-b"):
        await target.begin_call("r1", call)
        await target.put(make_entry("r1", call))
    return await target.freeze("r1")


def test_a_snapshot_holding_exactly_the_written_calls_is_accepted_and_its_latency_kept() -> None:
    latencies = _TrainerLatencies()
    frozen = asyncio.run(_write_two_calls_and_freeze(_target(["call-a", "call-b"], latencies)))
    assert frozen.entries == ("call-a", "call-b") and not frozen.incomplete
    assert latencies.under_load_ms == [1.5] and latencies.after_load_ms == []


@pytest.mark.parametrize("answered", [["call-a"], ["call-b", "call-a"], ["call-a", "call-b", "call-c"]])
def test_a_snapshot_missing_reordering_or_adding_a_call_fails_the_trial(answered: list[str]) -> None:
    with pytest.raises(BenchmarkCheckError, match="the load wrote"):
        asyncio.run(_write_two_calls_and_freeze(_target(answered, _TrainerLatencies())))


def test_a_freeze_after_the_last_put_counts_as_after_the_load() -> None:
    latencies = _TrainerLatencies(puts_done=True)
    asyncio.run(_write_two_calls_and_freeze(_target(["call-a", "call-b"], latencies)))
    assert latencies.under_load_ms == [] and latencies.after_load_ms == [1.5]

"""A broker restart while sinks in several processes write loses no acknowledged entry and duplicates none."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from store_contract import make_entry

from tokcap.errors import TransportError
from transports.kafka import KafkaTokenSink, KafkaTokenSource

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WORKERS = 3
ROLLOUTS_PER_WORKER = 4
PUTS_PER_WORKER = 160


def write_entries(bootstrap: str, topic: str, worker: int, ack_log: str, ready: Any, go: Any) -> None:
    """Worker process: put entries in small concurrent waves and log each acknowledged one.

    It starts writing only once every worker is ready (``go``): a worker that started early could otherwise
    finish all its puts while another is still importing, before the broker restart the test is about.
    """

    async def run() -> None:
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic, delivery_timeout_s=60)
        ready.set()
        if not go.wait(120):
            raise TimeoutError("the test never let the workers start")
        try:
            with Path(ack_log).open("ab", buffering=0) as acknowledged:
                for wave in range(0, PUTS_PER_WORKER, 4):
                    entries = [
                        make_entry(f"w{worker}-r{index % ROLLOUTS_PER_WORKER}", f"w{worker}-c{index}")
                        for index in range(wave, wave + 4)
                    ]
                    outcomes = await asyncio.gather(*(sink.put(e) for e in entries), return_exceptions=True)
                    for entry, outcome in zip(entries, outcomes, strict=True):
                        if isinstance(outcome, TransportError):
                            continue
                        if isinstance(outcome, BaseException):
                            raise outcome
                        record = {"rollout_id": entry.rollout_id, "model_call_id": entry.model_call_id}
                        acknowledged.write(orjson.dumps(record) + b"\n")
                    await asyncio.sleep(0.02)
        finally:
            await sink.close()

    asyncio.run(run())


def acknowledged_count(logs: list[Path]) -> list[int]:
    return [len(path.read_bytes().splitlines()) if path.exists() else 0 for path in logs]


def test_every_acknowledged_entry_is_in_its_snapshot_exactly_once_across_a_broker_restart(
    kafka_bootstrap: str, kafka_topic_factory: Any, kafka_broker_control: Any, tmp_path: Path
) -> None:
    topic = kafka_topic_factory("restart", partitions=2)
    logs = [tmp_path / f"acks-{worker}.jsonl" for worker in range(WORKERS)]
    context = multiprocessing.get_context("spawn")
    ready = [context.Event() for _ in range(WORKERS)]
    go = context.Event()
    workers = [
        context.Process(
            target=write_entries,
            args=(kafka_bootstrap, topic, worker, str(logs[worker]), ready[worker], go),
        )
        for worker in range(WORKERS)
    ]
    for process in workers:
        process.start()
    for worker, event in enumerate(ready):
        assert event.wait(120), f"writer {worker} never became ready"
    go.set()
    deadline = time.monotonic() + 120
    while min(acknowledged_count(logs)) < 20:
        assert time.monotonic() < deadline and all(p.is_alive() for p in workers), acknowledged_count(logs)
        time.sleep(0.05)
    kafka_broker_control.stop()
    stopped_at = acknowledged_count(logs)
    time.sleep(2)
    kafka_broker_control.start()
    for process in workers:
        process.join(240)
        assert process.exitcode == 0
    assert sum(acknowledged_count(logs)) > sum(stopped_at)

    acknowledged: dict[str, set[str]] = {}
    for path in logs:
        for line in path.read_bytes().splitlines():
            record = orjson.loads(line)
            acknowledged.setdefault(record["rollout_id"], set()).add(record["model_call_id"])

    async def check() -> None:
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap, topic=topic, store_dir=tmp_path / "store"
        )
        try:
            for rollout_id, calls in sorted(acknowledged.items()):
                snapshot = await source.freeze(rollout_id)
                stored = [entry.model_call_id for entry in snapshot.entries]
                assert len(stored) == len(set(stored)), rollout_id
                assert calls <= set(stored), (rollout_id, sorted(calls - set(stored)))
        finally:
            await source.close()

    asyncio.run(check())

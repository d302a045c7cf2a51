"""The Kafka load with the materializer in its own process, as a trainer node would run it.

The in-process materializer shares the GIL with every producing rollout of the benchmark; this variant gives
it its own interpreter (``python -m transports.kafka.materializer``) and lets the source wait on its
checkpoint files (``external_materializer=True``). Only the load is measured; replay is the same either way.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from bench.kafka_trial import KafkaTarget, delete_topic
from bench.load import LoadResult, PreparedWorkload, drive
from transports.kafka.client.topics import ensure_topic
from transports.kafka.materializer.checkpoint import applied_next_offset
from transports.kafka.sink import KafkaTokenSink
from transports.kafka.source import KafkaTokenSource

__all__ = [
    "ExternalMaterializerTrial",
    "MaterializerStartError",
    "metrics_url",
    "run_with_materializer_process",
    "start_materializer_process",
]

_READY_TIMEOUT_S = 60.0


class MaterializerStartError(RuntimeError):
    """The materializer process exited or did not report ready in time; its log tail says why."""


@dataclass(frozen=True)
class ExternalMaterializerTrial:
    """The load's figures and the backlog the materializer process had when the last put returned."""

    load: LoadResult
    lag_at_end_of_puts: int


def start_materializer_process(
    bootstrap: str, topic: str, directory: Path, log: Path, *, metrics: bool = False
) -> subprocess.Popen[bytes]:
    """``python -m transports.kafka.materializer`` on the topic, returned once it logged that it is ready.

    With ``metrics`` it serves ``/metrics`` on a free port (``metrics_url`` reads it from the log).
    """
    command = [sys.executable, "-m", "transports.kafka.materializer", "--bootstrap", bootstrap]
    command += ["--topic", topic, "--dir", str(directory)]
    if metrics:
        command += ["--metrics-port", "0"]
    with log.open("wb") as handle:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=handle)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while b"materializer ready" not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise MaterializerStartError(f"materializer process did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return process


def metrics_url(log: Path) -> str:
    """The ``/metrics`` address a materializer process started with ``metrics`` logged."""
    found = re.search(rb"serving /metrics and /healthz on (http://[0-9.]+:[0-9]+)", log.read_bytes())
    if found is None:
        raise MaterializerStartError(
            f"materializer process logged no metrics address: {log.read_text()[-2000:]}"
        )
    return found.group(1).decode() + "/metrics"


def _lag(bootstrap: str, topic: str, directory: Path) -> int:
    """Events in partition 0 the process has not checkpointed yet (bench topics have one partition)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-lag-{uuid.uuid4().hex}"})
    try:
        high = int(consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1])
    finally:
        consumer.close()
    applied = applied_next_offset(directory, topic, 0)
    return high - applied


async def run_with_materializer_process(
    workload: PreparedWorkload, bootstrap: str, directory: Path
) -> ExternalMaterializerTrial:
    """Drive the load through a fresh topic whose materializer runs in a child process."""
    topic = f"tokcap.bench-{uuid.uuid4().hex[:12]}"
    ensure_topic(bootstrap, topic)
    live = directory / "live"
    live.mkdir(parents=True, exist_ok=True)
    process = start_materializer_process(bootstrap, topic, live, directory / "materializer.log")
    try:
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
        source = KafkaTokenSource(
            bootstrap_servers=bootstrap, store_dir=live, topic=topic, external_materializer=True
        )
        lag: list[int] = []
        try:
            load = await drive(
                workload, KafkaTarget(sink, source), lambda: lag.append(_lag(bootstrap, topic, live))
            )
        finally:
            await sink.close()
            await source.close()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        delete_topic(bootstrap, topic)
    return ExternalMaterializerTrial(load=load, lag_at_end_of_puts=lag[0])

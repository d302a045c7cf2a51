"""A materializer's ``/metrics`` and ``/healthz``, scraped over HTTP while a real broker run is under way.

The materializer is held back the way a real one is: another process holds a rollout's lock file, so the
apply of that rollout's events waits while the sink goes on writing. The values scraped must move as the run
does: the lag rises while events arrive and nothing is applied, then falls to 0; ``/healthz`` is 503 until the
materializer applied what the log held when it started, then 200.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families
from store_contract import make_entry

from tokcap.cli.metrics_http import MetricsServer
from tokcap.log.events import FreezeEvent, PutEvent
from tokcap.metrics import REGISTRY
from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.errors import MaterializerOwnedElsewhereError
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.readiness import serve_metrics
from transports.kafka.wire.codec import encode_event_messages

pytestmark = pytest.mark.kafka

_SPILLED = "tokcap_sink_markers_spilled_total"
_FORWARDED = "tokcap_sink_markers_forwarded_total"
_SINK_COUNTERS = (_SPILLED, _FORWARDED)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as error:
        return int(error.code), bytes(error.read())


class Scraper:
    """Reads the served endpoints the way Prometheus and a readiness probe do."""

    def __init__(self, server: MetricsServer) -> None:
        self.base = f"http://127.0.0.1:{server.port}"

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, body = _get(self.base + "/metrics")
        assert status == 200
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        return self.samples().get((name, tuple(sorted(labels.items()))), 0.0)

    def health(self) -> tuple[int, str]:
        status, body = _get(self.base + "/healthz")
        return status, str(json.loads(body)["reason"])

    def until(self, what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not happen within {timeout_s} s; health: {self.health()}")
            time.sleep(0.1)


@contextmanager
def held_lock(path: Path) -> Iterator[None]:
    """Hold a rollout's lock file from another process, as a second writer or a repair would."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire(); "
            "print('held', flush=True); sys.stdin.read()",
            str(path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.wait(10)
        holder.stdout.close()


def _put_calls(bootstrap: str, topic: str, rollout_id: str, calls: range) -> None:
    async def run() -> None:
        sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
        try:
            for call in calls:
                await sink.put(make_entry(rollout_id, f"c{call}"))
        finally:
            await sink.close()

    asyncio.run(run())


def test_lag_rises_while_the_apply_is_held_and_falls_to_zero_and_healthz_turns_200_once_caught_up(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    rollout_id = f"r-lag-{uuid.uuid4().hex[:8]}"
    _put_calls(kafka_bootstrap, kafka_topic, rollout_id, range(20))
    materializer = Materializer(kafka_bootstrap, kafka_topic, tmp_path)
    server = serve_metrics(materializer, port=0)
    scrape = Scraper(server)
    partition = {"topic": kafka_topic, "partition": "0"}
    try:
        assert scrape.health()[0] == 503  # not started: it owns nothing yet
        with held_lock(materializer.store.lock_path_for(rollout_id)):
            materializer.start()
            scrape.until(
                "lag of the backlog",
                lambda: scrape.value("tokcap_materializer_lag_messages", **partition) >= 20,
            )
            assert scrape.value("tokcap_materializer_owned_partitions", topic=kafka_topic) == 1
            scrape.until("a 503 saying it catches up", lambda: scrape.health()[1].startswith("catching up"))
            assert scrape.health()[0] == 503
            _put_calls(kafka_bootstrap, kafka_topic, rollout_id, range(20, 30))
            scrape.until(
                "lag rising", lambda: scrape.value("tokcap_materializer_lag_messages", **partition) >= 30
            )
            scrape.until(
                "a waiting message aging",
                lambda: scrape.value("tokcap_materializer_lag_seconds", **partition) > 0,
            )
            assert scrape.health()[0] == 503
            applied_before = scrape.value("tokcap_materializer_events_applied_total", type="put")
        scrape.until(
            "lag back to 0", lambda: scrape.value("tokcap_materializer_lag_messages", **partition) == 0
        )
        scrape.until("healthy", lambda: scrape.health()[0] == 200)
        assert scrape.value("tokcap_materializer_lag_seconds", **partition) == 0
        assert scrape.value("tokcap_materializer_events_applied_total", type="put") >= applied_before + 30
        materializer.stop()
        status, reason = scrape.health()
        assert status == 503 and "no longer owns its partitions" in reason, reason
        assert scrape.value("tokcap_materializer_owned_partitions", topic=kafka_topic) == 0
    finally:
        materializer.stop()
        server.close()


def test_a_poison_event_counts_a_dead_letter_and_its_frozen_rollout_counts_as_masked(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    rollout_id = f"r-poison-{uuid.uuid4().hex[:8]}"
    materializer = Materializer(kafka_bootstrap, kafka_topic, tmp_path)
    server = serve_metrics(materializer, port=0)
    scrape = Scraper(server)
    try:
        materializer.start()
        scrape.until("healthy on an empty topic", lambda: scrape.health()[0] == 200)
        dead_before = scrape.value("tokcap_materializer_dead_letters_total", reason="undecodable")
        masked_before = scrape.value("tokcap_materializer_rollouts_masked_total", reason="dead_letter")
        _put_calls(kafka_bootstrap, kafka_topic, rollout_id, range(1))
        (freeze,) = encode_event_messages(
            FreezeEvent(rollout_id=rollout_id), next_chunk_group=lambda: "unused:0"
        )
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        producer.produce(kafka_topic, key=rollout_id.encode(), value=b"\x00not json", headers=[])
        producer.produce(kafka_topic, key=freeze.key, value=freeze.value, headers=freeze.headers)
        assert producer.flush(30) == 0
        scrape.until(
            "a dead letter",
            lambda: (
                scrape.value("tokcap_materializer_dead_letters_total", reason="undecodable")
                == dead_before + 1
            ),
        )
        scrape.until(
            "a masked rollout",
            lambda: (
                scrape.value("tokcap_materializer_rollouts_masked_total", reason="dead_letter")
                == masked_before + 1
            ),
        )
        assert scrape.value("tokcap_materializer_lag_messages", topic=kafka_topic, partition="0") == 0
        assert scrape.health()[0] == 200
        # A second materializer on the same directory cannot own the partition: its probe says why.
        second = Materializer(kafka_bootstrap, kafka_topic, tmp_path)
        second_server = serve_metrics(second, port=0)
        try:
            with pytest.raises(MaterializerOwnedElsewhereError):
                second.start()
            status, reason = Scraper(second_server).health()
            assert status == 503 and "already being materialized" in reason, reason
        finally:
            second.stop()
            second_server.close()
        assert scrape.health()[0] == 200
    finally:
        materializer.stop()
        server.close()


def test_tokcap_materialize_with_metrics_port_serves_metrics_and_healthz_on_localhost(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    _put_calls(kafka_bootstrap, kafka_topic, f"r-cli-{uuid.uuid4().hex[:8]}", range(5))
    process = subprocess.Popen(
        [sys.executable, "-m", "tokcap.cli", "materialize", "--bootstrap", kafka_bootstrap, "--topic", kafka_topic,
         "--dir", str(tmp_path / "store"), "--metrics-port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    assert process.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stderr or ()], daemon=True)
    reader.start()
    try:
        address = None
        deadline = time.monotonic() + 60
        while address is None and time.monotonic() < deadline:
            found = re.search(
                r"serving /metrics and /healthz on (http://127\.0\.0\.1:\d+)", lines.get(timeout=60)
            )
            address = found.group(1) if found else None
        assert address is not None, "the command did not say where it serves"
        deadline = time.monotonic() + 60
        while _get(address + "/healthz")[0] != 200:
            assert time.monotonic() < deadline, _get(address + "/healthz")
            time.sleep(0.2)
        status, body = _get(address + "/metrics")
        assert status == 200
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples
        }
        assert samples[("tokcap_materializer_owned_partitions", (("topic", kafka_topic),))] == 1
        assert (
            samples[("tokcap_materializer_lag_messages", (("partition", "0"), ("topic", kafka_topic)))] == 0
        )
        assert samples[("tokcap_materializer_events_applied_total", (("type", "put"),))] == 5
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        reader.join(10)
        process.stderr.close()


def test_a_sink_counts_bytes_it_sent_and_a_marker_it_spilled_that_a_later_sink_forwards(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    spill_dir = tmp_path / "spill"
    before = {name: REGISTRY.get_sample_value(name) or 0.0 for name in _SINK_COUNTERS}
    sent_before = REGISTRY.get_sample_value("tokcap_sink_sent_bytes_total", {"transport": "kafka"}) or 0.0

    async def run() -> None:
        unreachable = KafkaTokenSink(
            bootstrap_servers="127.0.0.1:1", topic=kafka_topic, delivery_timeout_s=1, spill_dir=spill_dir
        )
        await unreachable.mark_incomplete("r-spilled", "c1", "lost while the broker was away")
        await unreachable.close()
        assert REGISTRY.get_sample_value("tokcap_sink_markers_spilled_total") == before[_SPILLED] + 1
        assert REGISTRY.get_sample_value("tokcap_sink_markers_forwarded_total") == before[_FORWARDED]
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, spill_dir=spill_dir)
        try:
            deadline = time.monotonic() + 60
            while await sink.forward_spilled():
                assert time.monotonic() < deadline, "the spilled marker was never forwarded"
            await sink.put(make_entry("r-sent", "c1"))
        finally:
            await sink.close()

    asyncio.run(run())
    assert REGISTRY.get_sample_value("tokcap_sink_markers_forwarded_total") == before[_FORWARDED] + 1
    sent = (
        REGISTRY.get_sample_value("tokcap_sink_sent_bytes_total", {"transport": "kafka"}) or 0.0
    ) - sent_before
    # The forwarded marker and the put, keys and values, as the sink encoded them.
    put = PutEvent(rollout_id="r-sent", entry=make_entry("r-sent", "c1"))
    put_messages = encode_event_messages(put, next_chunk_group=lambda: "unused:0")
    assert sent > sum(len(message.value) for message in put_messages) // 2


def _count(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"{name}_count", labels) or 0.0


def _until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)


def test_each_answered_command_observes_its_wait_and_each_checkpoint_its_flush_time(
    kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path
) -> None:
    wait, flush = "tokcap_materializer_command_wait_seconds", "tokcap_materializer_flush_seconds"
    read_delay = "tokcap_materializer_command_read_delay_seconds"
    before = {kind: _count(wait, type=kind) for kind in ("freeze", "drop", "retire", "delete")} | {
        kind: _count(flush, kind=kind) for kind in ("commands", "sweep")
    }
    delays_before = {kind: _count(read_delay, type=kind) for kind in ("freeze", "drop", "retire", "delete")}
    freeze_delay_sum_before = REGISTRY.get_sample_value(f"{read_delay}_sum", {"type": "freeze"}) or 0.0

    # A materializer answering a source in another process: its commands are answered by their checkpoint.
    external_topic = kafka_topic_factory("external")
    materializer = Materializer(kafka_bootstrap, external_topic, tmp_path / "external")
    materializer.start()

    async def external_run() -> None:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=external_topic)
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap,
            topic=external_topic,
            store_dir=tmp_path / "external",
            external_materializer=True,
            timeout_s=30,
        )
        try:
            await sink.put(make_entry("r-wait", "c1"))
            snapshot = await source.freeze("r-wait")
            assert await source.drop("r-wait", snapshot.snapshot_id, snapshot.version)
            await sink.put(make_entry("r-gone", "c1"))
            await source.retire(["r-gone"])
            await source.delete(["r-gone"])
        finally:
            await sink.close()
            await source.close()

    try:
        asyncio.run(external_run())
        for kind in ("freeze", "drop", "retire", "delete"):
            _until(f"a {kind} wait observed", lambda kind=kind: _count(wait, type=kind) == before[kind] + 1)
    finally:
        materializer.stop()
    # Each command's time in the log before the materializer read it: once per command, on the wall clock.
    assert {kind: _count(read_delay, type=kind) - delays_before[kind] for kind in delays_before} == {
        "freeze": 1,
        "drop": 1,
        "retire": 1,
        "delete": 1,
    }
    # Earlier tests in this process may have replayed commands stamped long ago: only this one's delay counts.
    freeze_delay = (
        REGISTRY.get_sample_value(f"{read_delay}_sum", {"type": "freeze"}) or 0.0
    ) - freeze_delay_sum_before
    assert 0 <= freeze_delay < 30
    assert _count(flush, kind="commands") >= before["commands"] + 1
    assert _count(flush, kind="sweep") >= before["sweep"] + 1
    assert (REGISTRY.get_sample_value(f"{wait}_sum", {"type": "freeze"}) or 0.0) > 0

    # An in-process source's freeze is answered from memory, before its block is flushed: observed once too.
    in_process_topic = kafka_topic_factory("in-process")
    freezes = _count(wait, type="freeze")

    async def in_process_run() -> None:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=in_process_topic)
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap, topic=in_process_topic, store_dir=tmp_path / "in-process"
        )
        try:
            await sink.put(make_entry("r-ahead", "c1"))
            await source.freeze("r-ahead")
            assert _count(wait, type="freeze") == freezes + 1
        finally:
            await sink.close()
            await source.close()

    asyncio.run(in_process_run())

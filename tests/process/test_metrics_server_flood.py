"""A flood of idle and slow connections on the metrics port never stops the materializer serving it.

The materializer runs as its own process with a descriptor limit (``RLIMIT_NOFILE``) lower than the number of
connections a second process holds open against its metrics port: idle ones that send nothing and slow ones
that trickle a request head that never ends, each opened again as soon as the server closes it. While that
lasts, the materializer must go on applying the run (a freeze through it answers with every entry written
during the flood) and answer a ``/healthz`` probe within 5 s each time it is asked.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from store_contract import make_entry

from transports.kafka import KafkaTokenSink, KafkaTokenSource

pytestmark = pytest.mark.kafka

_DESCRIPTOR_LIMIT = 256
_IDLE = 300
_SLOW = 40
_FLOOD = Path(__file__).resolve().parent.parent / "http_flood.py"
_SERVING = re.compile(r"serving /metrics and /healthz on (http://127\.0\.0\.1:\d+)")


def _lower_descriptor_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_DESCRIPTOR_LIMIT, hard))


def _materializer_command(kind: str, bootstrap: str, topic: str, store_dir: Path) -> list[str]:
    if kind == "tokcap materialize":
        return [sys.executable, "-m", "tokcap.cli", "materialize", "--bootstrap", bootstrap, "--topic", topic,
                "--dir", str(store_dir), "--metrics-port", "0"]  # fmt: skip
    return [sys.executable, "-m", "transports.kafka.materializer", "--bootstrap", bootstrap, "--topic", topic,
            "--dir", str(store_dir), "--metrics-port", "0"]  # fmt: skip


@contextmanager
def _materializer(command: list[str]) -> Iterator[tuple[str, list[str]]]:
    """Start it with the lowered limit; yield where it serves and the lines of its log so far."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_lower_descriptor_limit,
    )
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    log: list[str] = []
    assert process.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stderr or ()], daemon=True)
    reader.start()
    try:
        address = None
        deadline = time.monotonic() + 60
        while address is None:
            assert time.monotonic() < deadline and process.poll() is None, "".join(log)
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            log.append(line)
            found = _SERVING.search(line)
            address = found.group(1) if found else None
        yield address, log
        assert process.poll() is None, "the materializer exited during the flood:\n" + "".join(log)[-3000:]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        reader.join(10)
        process.stderr.close()
        while not lines.empty():
            log.append(lines.get())
        sys.stderr.write("materializer log (tail):\n" + "".join(log)[-3000:])


def _health(address: str) -> int:
    """The probe's status; it fails (a timeout) if no answer comes within 5 s."""
    try:
        with urllib.request.urlopen(address + "/healthz", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


@contextmanager
def _flood(address: str) -> Iterator[dict[str, int]]:
    """Hold the idle and slow connections from another process; yield the counts it reports at the end."""
    port = address.rsplit(":", 1)[1]
    flood = subprocess.Popen(
        [sys.executable, str(_FLOOD), port, "--idle", str(_IDLE), "--slow", str(_SLOW), "--seconds", "120"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    counts: dict[str, int] = {}
    assert flood.stdin is not None and flood.stdout is not None
    try:
        assert flood.stdout.readline().strip() == "holding"
        yield counts
    finally:
        flood.stdin.close()
        counts.update(json.loads(flood.stdout.readline() or "{}"))
        flood.wait(30)
        flood.stdout.close()


async def _write_and_freeze(bootstrap: str, topic: str, store_dir: Path, rollout_id: str) -> list[str]:
    sink = KafkaTokenSink(bootstrap_servers=bootstrap, topic=topic)
    source = KafkaTokenSource(
        bootstrap_servers=bootstrap,
        topic=topic,
        store_dir=store_dir,
        external_materializer=True,
        timeout_s=60,
    )
    try:
        for call in ("c1", "c2", "c3"):
            await sink.begin_call(rollout_id, call)
            await sink.put(make_entry(rollout_id, call))
        snapshot = await source.freeze(rollout_id)
        return sorted(entry.model_call_id for entry in snapshot.entries)
    finally:
        await sink.close()
        await source.close()


@pytest.mark.parametrize("kind", ["tokcap materialize", "python -m transports.kafka.materializer"])
def test_a_flood_of_idle_and_slow_metrics_connections_neither_stops_the_materializer_nor_its_health_probe(
    kind: str, kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    store_dir = tmp_path / "store"
    command = _materializer_command(kind, kafka_bootstrap, kafka_topic, store_dir)
    with _materializer(command) as (address, log):
        deadline = time.monotonic() + 60
        while _health(address) != 200:
            assert time.monotonic() < deadline, "the materializer never became ready"
            time.sleep(0.2)
        with _flood(address) as counts:
            for round_ in range(3):
                assert _health(address) == 200
                rollout_id = f"r-flood-{round_}-{uuid.uuid4().hex[:6]}"
                frozen = asyncio.run(_write_and_freeze(kafka_bootstrap, kafka_topic, store_dir, rollout_id))
                assert frozen == ["c1", "c2", "c3"]
                assert _health(address) == 200
    assert counts["opened"] > _DESCRIPTOR_LIMIT, counts
    assert not any("Too many open files" in line for line in log), "".join(log)[-3000:]

"""``mark_incomplete`` is more available than ``put``: with the broker down the marker is spilled, and forwarded.

Against the real broker: the session broker is stopped and started again, and a process is killed with its
marker still spilled. Each marker must reach the log exactly once and mask its rollout.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from store_contract import make_entry

from tokcap.errors import TransportError
from tokcap.log.events import IncompleteEvent
from transports.kafka import KafkaTokenSink, KafkaTokenSource
from transports.kafka.timeline import read_log
from transports.kafka.wire.codec import decode_message, headers_to_dict

pytestmark = pytest.mark.kafka


def markers_in_log(bootstrap: str, topic: str, rollout_id: str) -> list[IncompleteEvent]:
    """Every incomplete event of the rollout in the topic, in log order."""
    events = [
        decode_message(message.key, message.value, headers_to_dict(message.headers))
        for message in read_log(bootstrap, topic, key=rollout_id.encode())
    ]
    return [event for event in events if isinstance(event, IncompleteEvent)]


async def forward_until_done(sink: KafkaTokenSink, timeout_s: float = 120.0) -> None:
    """Forward the sink's spill until the broker took every marker (it may still be reconnecting)."""
    deadline = time.monotonic() + timeout_s
    while await sink.forward_spilled():
        assert time.monotonic() < deadline, "spilled markers were never forwarded"


def test_with_the_broker_down_put_fails_mark_incomplete_succeeds_and_the_rollout_is_masked_once_it_is_back(
    kafka_bootstrap: str, kafka_topic: str, kafka_broker_control: Any, tmp_path: Path
) -> None:
    async def scenario() -> None:
        sink = KafkaTokenSink(
            bootstrap_servers=kafka_bootstrap,
            topic=kafka_topic,
            delivery_timeout_s=3,
            spill_dir=tmp_path / "spill",
        )
        try:
            await sink.put(make_entry("r-down", "c1"))
            kafka_broker_control.stop()
            with pytest.raises(TransportError):
                await sink.put(make_entry("r-down", "c2"))
            await sink.mark_incomplete("r-down", "c2", "put failed: broker down")
            assert sink.spilled_markers == 1
            kafka_broker_control.start()
            await forward_until_done(sink)
        finally:
            await sink.close()
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "store"
        )
        try:
            snapshot = await source.freeze("r-down")
        finally:
            await source.close()
        assert [entry.model_call_id for entry in snapshot.entries] == ["c1"]
        assert snapshot.incomplete

    asyncio.run(scenario())
    (marker,) = markers_in_log(kafka_bootstrap, kafka_topic, "r-down")
    assert (marker.model_call_id, marker.reason) == ("c2", "put failed: broker down")
    assert list((tmp_path / "spill" / kafka_topic).iterdir()) == []


def spill_and_wait_to_be_killed(topic: str, spill_dir: str, ready: str) -> None:
    """Child process: spill a marker (no broker answers at this address), say so, and wait to be killed."""

    async def run() -> None:
        sink = KafkaTokenSink(
            bootstrap_servers="127.0.0.1:1", topic=topic, delivery_timeout_s=1, spill_dir=spill_dir
        )
        await sink.mark_incomplete("r-killed", "c1", "lost before the crash")
        # Renamed into place: the parent kills this process as soon as the file exists, and a file created
        # by ``write_text`` exists (empty) before its text is written (a fresh-clone CI run read "" so).
        staged = Path(ready + ".tmp")
        staged.write_text(sink.writer_id)
        os.replace(staged, ready)
        await asyncio.Event().wait()

    asyncio.run(run())


def test_a_new_sink_forwards_exactly_once_the_marker_a_killed_process_left_spilled(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    spill_dir, ready = tmp_path / "spill", tmp_path / "ready"
    child = multiprocessing.get_context("spawn").Process(
        target=spill_and_wait_to_be_killed, args=(kafka_topic, str(spill_dir), str(ready))
    )
    child.start()
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.is_alive() and time.monotonic() < deadline, "the child never spilled its marker"
            time.sleep(0.05)
    finally:
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(30)
    killed_writer = ready.read_text()
    assert len(list((spill_dir / kafka_topic).glob("*.marker"))) == 1

    async def scenario() -> None:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, spill_dir=spill_dir)
        try:
            await forward_until_done(sink)
        finally:
            await sink.close()
        source = KafkaTokenSource(
            bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path / "store"
        )
        try:
            snapshot = await source.freeze("r-killed")
        finally:
            await source.close()
        assert snapshot.incomplete

    asyncio.run(scenario())
    (marker,) = markers_in_log(kafka_bootstrap, kafka_topic, "r-killed")
    assert (marker.writer, marker.model_call_id, marker.reason) == (
        killed_writer,
        "c1",
        "lost before the crash",
    )
    assert list((spill_dir / kafka_topic).iterdir()) == []

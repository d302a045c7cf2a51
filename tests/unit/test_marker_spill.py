"""Incomplete markers spilled to local disk: durable until acknowledged, forwarded once, adopted after a crash.

The spill's files are tested directly; the sink's use of them with a fake producer bridge that fails on
demand (fault injection). The real broker going down and a killed process are in
tests/integration/test_kafka_marker_spill.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from store_contract import make_entry

from tokcap.errors import DeliveryError, DeliveryTimeoutError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import IncompleteEvent, LogPosition, decode_event
from transports.kafka import KafkaTokenSink
from transports.kafka import sink as sink_module
from transports.kafka.client.producer_bridge import Delivered
from transports.kafka.wire.codec import OutgoingMessage
from transports.kafka.write.marker_spill import MarkerSpill

TOPIC = "tokcap.spill-test"


def marker(session: str, sequence: int, rollout_id: str = "r1") -> IncompleteEvent:
    return IncompleteEvent(
        rollout_id=rollout_id, model_call_id="c1", reason="lost", marker_id=f"{session}-{sequence}"
    )


def test_a_spilled_marker_is_one_whole_file_until_removed_and_the_session_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    spill = MarkerSpill(tmp_path, "a1")
    assert not tmp_path.joinpath("a1.lock").exists()
    first, second = spill.write(marker("a1", 0)), spill.write(marker("a1", 1))
    assert decode_event(first.path.read_bytes()) == marker("a1", 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a1-0.marker", "a1-1.marker", "a1.lock"]
    assert [m.marker_id for m in spill.pending()] == ["a1-0", "a1-1"]
    spill.remove(first)
    spill.remove(second)
    assert spill.pending() == [] and spill.close() == 0
    assert list(tmp_path.iterdir()) == []


def test_the_markers_of_a_live_session_are_never_adopted_and_those_of_a_dead_one_exactly_once(
    tmp_path: Path,
) -> None:
    live, dying = MarkerSpill(tmp_path, "live"), MarkerSpill(tmp_path, "dying")
    live.write(marker("live", 0))
    dying.write(marker("dying", 0))
    dying.write(marker("dying", 1))
    assert dying.close() == 2  # its lock is let go, as the kernel does when a process dies

    adopter, latecomer = MarkerSpill(tmp_path, "adopter"), MarkerSpill(tmp_path, "late")
    assert [m.marker_id for m in adopter.adopt_dead_sessions()] == ["dying-0", "dying-1"]
    assert latecomer.adopt_dead_sessions() == []
    for adopted in adopter.pending():
        adopter.remove(adopted)
    assert not tmp_path.joinpath("dying.lock").exists()
    assert [m.marker_id for m in live.pending()] == ["live-0"]


def test_a_half_written_marker_of_a_dead_session_is_removed_unread(tmp_path: Path) -> None:
    tmp_path.joinpath("dead.lock").write_bytes(b"")
    tmp_path.joinpath(".dead-0.marker.tmp").write_bytes(b'{"type": "incomp')
    assert MarkerSpill(tmp_path, "new").adopt_dead_sessions() == []
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_marker_is_set_aside_and_reported_never_forwarded_or_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tmp_path.joinpath("dead.lock").write_bytes(b"")
    tmp_path.joinpath("dead-0.marker").write_bytes(b"\x00 not a marker")
    with caplog.at_level(logging.ERROR):
        assert MarkerSpill(tmp_path, "new").adopt_dead_sessions() == []
    assert tmp_path.joinpath("dead-0.marker.corrupt").read_bytes() == b"\x00 not a marker"
    assert "unreadable" in caplog.text and "dead-0.marker" in caplog.text


def test_anything_in_the_spill_that_is_not_a_readable_marker_is_set_aside_and_the_readable_ones_are_adopted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dying = MarkerSpill(tmp_path, "dead")
    dying.write(marker("dead", 1))
    dying.close()
    tmp_path.joinpath("dead-2.marker").mkdir()
    tmp_path.joinpath("dead-3.marker").symlink_to(tmp_path / "dead-1.marker")
    os.mkfifo(tmp_path / "dead-4.marker")
    tmp_path.joinpath(".dead-5.marker.tmp").mkdir()
    tmp_path.joinpath("ghost.lock").mkdir()
    with caplog.at_level(logging.ERROR):
        adopted = MarkerSpill(tmp_path, "new").adopt_dead_sessions()
    assert [m.marker_id for m in adopted] == ["dead-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".dead-5.marker.tmp.corrupt",
        "dead-1.marker",
        "dead-2.marker.corrupt",
        "dead-3.marker.corrupt",
        "dead-4.marker.corrupt",
        "dead.lock",
        "ghost.lock.corrupt",
    ]
    for name in ("dead-2.marker", "dead-3.marker", "dead-4.marker", ".dead-5.marker.tmp", "ghost.lock"):
        assert f"{name} " in caplog.text


# ------------------------------------------------------------------------- the sink, with injected faults


class FakeBroker:
    """The log a fake bridge writes; ``down`` fails every send; the next ``lose_acks`` sends write, then fail."""

    def __init__(self) -> None:
        self.log: list[OutgoingMessage] = []
        self.down = False
        self.lose_acks = 0

    def markers(self) -> list[IncompleteEvent]:
        events = [decode_event(m.value) for m in self.log]
        return [e for e in events if isinstance(e, IncompleteEvent)]


class FakeBridge:
    """Stands in for ``ProducerBridge``: same constructor and ``send``, no librdkafka."""

    broker = FakeBroker()

    def __init__(self, bootstrap_servers: str, **_: Any) -> None:
        self.delivery_timeout_s = 1.0

    async def send(self, topic: str, messages: Sequence[OutgoingMessage], *, what: str) -> list[Delivered]:
        if self.broker.down:
            raise DeliveryTimeoutError(f"{what} was not acknowledged (the fake broker is down)")
        self.broker.log.extend(messages)
        if self.broker.lose_acks > 0:
            self.broker.lose_acks -= 1
            raise DeliveryTimeoutError(f"{what}: the acknowledgement was lost")
        return [Delivered(0, len(self.broker.log) - 1)]

    def close(self, timeout_s: float | None = None) -> int:
        return 0


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBroker]:
    FakeBridge.broker = FakeBroker()
    monkeypatch.setattr(sink_module, "ProducerBridge", FakeBridge)
    yield FakeBridge.broker


def new_sink(spill_dir: Path) -> KafkaTokenSink:
    return KafkaTokenSink(bootstrap_servers="fake:9092", topic=TOPIC, spill_dir=spill_dir)


def test_mark_incomplete_returns_while_the_broker_is_down_and_the_marker_reaches_the_log_once_it_answers(
    broker: FakeBroker, tmp_path: Path
) -> None:
    async def scenario() -> None:
        sink = new_sink(tmp_path)
        try:
            broker.down = True
            with pytest.raises(DeliveryTimeoutError):
                await sink.put(make_entry("r1", "c1"))
            await sink.mark_incomplete("r1", "c1", "put failed")
            assert sink.spilled_markers == 1 and broker.log == []
            broker.down = False
            assert await sink.forward_spilled() == 0
        finally:
            await sink.close()

    asyncio.run(scenario())
    (forwarded,) = broker.markers()
    assert (forwarded.rollout_id, forwarded.model_call_id, forwarded.reason) == ("r1", "c1", "put failed")
    assert list(tmp_path.joinpath(TOPIC).iterdir()) == []


def test_a_marker_the_broker_acknowledged_leaves_nothing_spilled(broker: FakeBroker, tmp_path: Path) -> None:
    async def scenario() -> None:
        sink = new_sink(tmp_path)
        try:
            await sink.mark_incomplete("r1", "c1", "lost")
            assert sink.spilled_markers == 0
        finally:
            await sink.close()

    asyncio.run(scenario())
    assert len(broker.markers()) == 1 and broker.markers()[0].marker_id
    assert list(tmp_path.joinpath(TOPIC).iterdir()) == []


def test_when_neither_the_broker_nor_the_spill_takes_a_marker_mark_incomplete_raises_naming_both(
    broker: FakeBroker, tmp_path: Path
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_bytes(b"")
    broker.down = True

    async def scenario() -> None:
        sink = new_sink(blocked)
        try:
            with pytest.raises(DeliveryError) as raised:
                await sink.mark_incomplete("r1", "c1", "lost")
            assert "fake broker is down" in str(raised.value) and "cannot spill" in str(raised.value)
            assert "not-a-directory" in str(raised.value)
        finally:
            await sink.close()

    asyncio.run(scenario())


def test_a_new_sink_forwards_the_markers_a_stopped_sink_left_spilled(
    broker: FakeBroker, tmp_path: Path
) -> None:
    async def scenario() -> None:
        broker.down = True
        first = new_sink(tmp_path)
        await first.mark_incomplete("r1", "c1", "lost")
        await first.mark_incomplete("r2", "c9", "lost too")
        await first.close()
        assert len(list(tmp_path.joinpath(TOPIC).glob("*.marker"))) == 2
        broker.down = False
        second = new_sink(tmp_path)
        try:
            assert await second.forward_spilled() == 0
        finally:
            await second.close()
        assert [(m.rollout_id, m.writer) for m in broker.markers()] == [
            ("r1", first.writer_id),
            ("r2", first.writer_id),
        ]

    asyncio.run(scenario())
    assert list(tmp_path.joinpath(TOPIC).iterdir()) == []


def test_a_directory_among_the_spilled_markers_does_not_stop_a_sink_from_starting_and_forwarding_the_rest(
    broker: FakeBroker, tmp_path: Path
) -> None:
    spill = tmp_path / TOPIC
    dying = MarkerSpill(spill, "dead")
    dying.write(marker("dead", 1, rollout_id="r7"))
    dying.close()
    spill.joinpath("dead-2.marker").mkdir()

    async def scenario() -> None:
        sink = new_sink(tmp_path)
        try:
            assert await sink.forward_spilled() == 0
        finally:
            await sink.close()

    asyncio.run(scenario())
    assert [(m.rollout_id, m.marker_id) for m in broker.markers()] == [("r7", "dead-1")]
    assert sorted(p.name for p in spill.iterdir()) == ["dead-2.marker.corrupt"]


def test_a_marker_forwarded_again_after_a_lost_acknowledgement_is_applied_once(
    broker: FakeBroker, tmp_path: Path
) -> None:
    async def scenario() -> None:
        sink = new_sink(tmp_path / "spill")
        try:
            broker.lose_acks = 1
            await sink.mark_incomplete("r1", "c1", "lost")
            assert await sink.forward_spilled() == 0
        finally:
            await sink.close()

    asyncio.run(scenario())
    first, again = broker.markers()
    assert first == again
    store = TokenCaptureStore(tmp_path / "store")
    for offset, event in enumerate(broker.markers()):
        store.apply(event, LogPosition(TOPIC, 0, offset))
    state = store.read_state("r1")
    assert (state.version, len(state.incomplete_marks), state.incomplete_size) == (1, 1, len(b"c1\n"))


def test_the_spill_directory_defaults_to_the_environment_or_the_users_cache(
    broker: FakeBroker, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TOKCAP_SPILL_DIR", str(tmp_path / "env"))
    broker.down = True

    async def scenario() -> None:
        sink = KafkaTokenSink(bootstrap_servers="fake:9092", topic=TOPIC)
        try:
            await sink.mark_incomplete("r1", "c1", "lost")
        finally:
            await sink.close()

    asyncio.run(scenario())
    assert len(list((tmp_path / "env" / TOPIC).glob("*.marker"))) == 1
    monkeypatch.delenv("TOKCAP_SPILL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from transports.kafka.write.marker_spill import default_spill_dir

    assert default_spill_dir() == tmp_path / "cache" / "tokcap" / "spill"
    assert os.path.isabs(default_spill_dir())

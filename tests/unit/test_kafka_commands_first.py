"""Commands first: a freeze is carried out ahead of other rollouts' backlog, and the store still ends as a
clean in-order replay leaves it, byte for byte, however the rollouts interleave and wherever a run crashes.

The reference is the same materializer with no read-ahead (``read_ahead_messages=1``): it applies every
message in log order, as the materializer did before commands went first.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_topic_double import MemoryTopic, materialize
from store_contract import directory_contents, make_entry

import transports.kafka.materializer.apply_decisions as apply_module
import transports.kafka.materializer.loop as materializer_module
from tokcap.log.events import (
    CancelEvent,
    DeleteEvent,
    DropEvent,
    FreezeEvent,
    IncompleteEvent,
    IntentEvent,
    LogPosition,
    PutEvent,
    RetireEvent,
)
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.checkpoint import PartitionCheckpoint, checkpoint_path, command_applied
from transports.kafka.materializer.settings import DEFAULT_SETTINGS
from transports.kafka.source import _CheckpointWaiter
from transports.kafka.wire.codec import encode_event_messages
from transports.kafka.wire.router import ApplyEvent, Routed

TOPIC = "tokcap.commands-first-test"

OPS = (
    "intent",
    "put",
    "big",
    "torn",
    "cancel",
    "incomplete",
    "freeze",
    "late",
    "drop",
    "retire",
    "delete",
    "junk",
)


def files(directory: Path) -> dict[str, bytes]:
    """Every file's bytes by name, locks left out (they hold no state)."""
    return {name: data for name, data in directory_contents(directory).items() if not name.endswith(".lock")}


@contextmanager
def loop_sizes(*, batch: int, step: int, read_ahead: int | None = None) -> Iterator[None]:
    """Small loop turns, so a short log still takes many turns and commands jump many messages."""
    sizes = replace(DEFAULT_SETTINGS, block_messages=batch, read_step=step)
    if read_ahead is not None:
        sizes = replace(sizes, read_ahead_messages=read_ahead)
    with mock.patch.object(materializer_module, "DEFAULT_SETTINGS", sizes):
        yield


def in_order(topic: MemoryTopic, directory: Path) -> dict[str, bytes]:
    """What a materializer applying strictly in log order leaves."""
    with loop_sizes(batch=1, step=1, read_ahead=1):
        counters = materialize(topic, directory).counters()
    assert counters.commands_ahead == 0
    return files(directory)


@dataclass
class LogWriter:
    """Publishes one rollout-interleaved history into a memory topic, as sinks and sources would."""

    topic: MemoryTopic
    generation: dict[str, int] = field(default_factory=dict)
    freeze_offset: dict[str, int] = field(default_factory=dict)
    groups: int = 0

    def chunked(self, rollout_id: str, call_id: str, *, keep: int | None = None) -> None:
        """A put in 2 KiB chunks from writer session ``w``; ``keep`` publishes only its first chunks."""
        event = PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, call_id, tokens=900))
        self.groups += 1
        messages = encode_event_messages(event, chunk_bytes=2048, next_chunk_group=lambda: f"w:{self.groups}")
        for message in messages[:keep]:
            self.topic.produce(message.key, message.value, message.headers)

    def write(self, rollout_id: str, op: str, call: int) -> None:
        call_id = f"c{call}"
        if op == "intent":
            self.topic.publish(IntentEvent(rollout_id=rollout_id, model_call_id=call_id))
        elif op in ("put", "late"):
            self.topic.publish(PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, call_id)))
        elif op == "big":
            self.chunked(rollout_id, call_id)
        elif op == "torn":
            self.chunked(rollout_id, call_id, keep=1)
        elif op == "cancel":
            self.topic.publish(CancelEvent(rollout_id=rollout_id, model_call_id=call_id))
        elif op == "incomplete":
            self.topic.publish(IncompleteEvent(rollout_id=rollout_id, model_call_id=call_id, reason="lost"))
        elif op == "freeze":
            (self.freeze_offset[rollout_id],) = self.topic.publish(FreezeEvent(rollout_id=rollout_id))
        elif op == "drop":
            at = self.freeze_offset.get(rollout_id, 0)
            event = DropEvent(rollout_id=rollout_id, snapshot_id=f"{TOPIC}:0:{at}", version=1 + call % 2)
            self.topic.publish(event)
        elif op == "retire":
            self.topic.publish(RetireEvent(rollout_id=rollout_id))
        elif op == "delete":
            self.topic.publish(DeleteEvent(rollout_id=rollout_id))
        elif op == "junk":
            self.topic.produce(rollout_id.encode(), b"\xffnot an event", [("tokcap-type", b"put")])


def write_history(topic: MemoryTopic, scripts: dict[str, list[tuple[str, int]]], order: list[str]) -> None:
    """Publish each rollout's script in its own order, the rollouts interleaved as ``order`` picks them."""
    writer = LogWriter(topic)
    cursors = dict.fromkeys(scripts, 0)
    for rollout_id in order:
        if cursors[rollout_id] < len(scripts[rollout_id]):
            op, call = scripts[rollout_id][cursors[rollout_id]]
            writer.write(rollout_id, op, call)
            cursors[rollout_id] += 1
    for rollout_id, script in scripts.items():
        for op, call in script[cursors[rollout_id] :]:
            writer.write(rollout_id, op, call)


def busy_log(topic: MemoryTopic, backlog: int) -> int:
    """Rollout ``a`` writes a call, rollout ``busy`` a backlog of puts, then ``a`` is frozen: the freeze's offset."""
    topic.publish(IntentEvent(rollout_id="a", model_call_id="c0"))
    topic.publish(PutEvent(rollout_id="a", entry=make_entry("a", "c0")))
    for call in range(backlog):
        topic.publish(PutEvent(rollout_id="busy", entry=make_entry("busy", f"c{call}")))
    (offset,) = topic.publish(FreezeEvent(rollout_id="a"))
    return offset


def test_a_freeze_is_carried_out_ahead_of_other_rollouts_backlog_and_the_store_ends_as_in_order(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    freeze_at = busy_log(topic, 600)
    materializer = materialize(topic, tmp_path / "ahead")
    counters = materializer.counters()
    # Read in one step, the freeze went first: its own rollout's two events, then itself, with every put of
    # the other rollout still waiting before it.
    assert counters.commands_ahead == 1
    assert counters.decisions_ahead == 3
    assert counters.backlog_skipped == freeze_at
    assert counters.messages_swept == counters.messages_routed == freeze_at + 1
    snapshot = materializer.store.snapshot("a")
    assert (snapshot.snapshot_id, [e.model_call_id for e in snapshot.entries]) == (
        f"{TOPIC}:0:{freeze_at}",
        ["c0"],
    )
    assert files(tmp_path / "ahead") == in_order(topic, tmp_path / "in-order")


def test_a_command_wait_is_answered_while_the_backlog_before_it_is_held_back(tmp_path: Path) -> None:
    topic = MemoryTopic(TOPIC)
    freeze_at = busy_log(topic, 400)
    release = threading.Event()
    real = apply_module.carry_out

    def held_for_busy(store: Any, topic_name: str, routed: Routed) -> Any:
        """The other rollout's events wait until the test lets them go."""
        if isinstance(routed, ApplyEvent) and routed.event.rollout_id == "busy":
            assert release.wait(60)
        return real(store, topic_name, routed)

    async def waits() -> tuple[bool, int, bool, int]:
        materializer = Materializer(
            "memory", TOPIC, tmp_path, consumer_factory=topic.consumer, topic_id_reader=topic.topic_id
        )
        materializer.start()
        try:
            frozen = await materializer.applied(0, freeze_at, 60, command=True)
            applied_then = materializer.applied_offsets()[0]
            # A source in another process reads the same answer from the checkpoint.
            frozen = frozen and command_applied(tmp_path, TOPIC, 0, freeze_at)
            frozen = frozen and not command_applied(tmp_path, TOPIC, 0, freeze_at - 1)
            release.set()
            whole = await materializer.applied(0, freeze_at, 60)
            return frozen, applied_then, whole, materializer.applied_offsets()[0]
        finally:
            release.set()
            materializer.stop()

    with loop_sizes(batch=1, step=1_000), mock.patch.object(apply_module, "carry_out", held_for_busy):
        frozen, applied_then, whole, applied_after = asyncio.run(waits())
    assert frozen and applied_then <= 2 < freeze_at
    assert whole and applied_after > freeze_at


def test_the_read_ahead_is_bounded_and_a_command_past_it_waits_for_room(tmp_path: Path) -> None:
    topic = MemoryTopic(TOPIC)
    busy_log(topic, 300)
    with loop_sizes(batch=50, step=1_000, read_ahead=100):
        counters = materialize(topic, tmp_path / "bounded").counters()
    # The freeze is 302 messages in: it is first read once at most 100 messages are held, 200 in.
    assert counters.commands_ahead == 1
    assert 0 < counters.backlog_skipped <= 100
    assert files(tmp_path / "bounded") == in_order(topic, tmp_path / "in-order")


scripts_strategy = st.dictionaries(
    st.sampled_from(["r0", "r1", "r2", "r3"]),
    st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 3)), min_size=1, max_size=14),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    scripts=scripts_strategy,
    order_seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 4),
    step=st.integers(1, 12),
)
def test_any_interleaving_of_rollouts_ends_byte_identical_to_an_in_order_replay(
    scripts: dict[str, list[tuple[str, int]]], order_seed: int, batch: int, step: int, tmp_path_factory: Any
) -> None:
    total = sum(len(script) for script in scripts.values())
    rng = random.Random(order_seed)
    order = [rollout_id for rollout_id, script in scripts.items() for _ in script]
    rng.shuffle(order)
    topic = MemoryTopic(TOPIC)
    write_history(topic, scripts, order[:total])
    root = tmp_path_factory.mktemp("interleaving")
    with loop_sizes(batch=batch, step=step):
        materialize(topic, root / "ahead")
    assert files(root / "ahead") == in_order(topic, root / "in-order")


class Crash(Exception):
    """Stands for the process dying at this point."""


def crashing_after(calls: int) -> Callable[..., Any]:
    """``carry_out`` that dies before its ``calls + 1``-th decision, as a SIGKILL there would."""
    real = apply_module.carry_out
    done = [0]

    def carry_out(store: Any, topic: str, routed: Routed) -> Any:
        if done[0] == calls:
            raise Crash(f"killed before decision {calls}")
        done[0] += 1
        return real(store, topic, routed)

    return carry_out


def crash_history(topic: MemoryTopic) -> None:
    """Freezes, drops, retires and deletes of some rollouts behind others' backlog, torn and whole chunk groups,
    an undecodable message: every kind of decision, many carried out ahead."""
    scripts = {
        "r0": [("intent", 0), ("big", 0), ("freeze", 0), ("late", 1), ("drop", 1), ("delete", 0), ("put", 2)],
        "r1": [("intent", 0), ("put", 0), ("torn", 1), ("junk", 0), ("freeze", 0), ("retire", 0)],
        "r2": [("put", 0), ("put", 1), ("put", 2), ("intent", 3), ("incomplete", 3), ("freeze", 0)],
        "busy": [("put", call) for call in range(12)],
    }
    order = ["busy"] * 6 + ["r0", "r1", "r2"] * 3 + ["busy"] * 6 + ["r2", "r0", "r1"] * 4
    write_history(topic, scripts, order)


def test_a_materializer_killed_before_any_decision_resumes_to_the_bytes_of_an_in_order_replay(
    tmp_path: Path,
) -> None:
    topic = MemoryTopic(TOPIC)
    crash_history(topic)
    expected = in_order(topic, tmp_path / "in-order")
    with loop_sizes(batch=3, step=8):
        ahead = materialize(topic, tmp_path / "clean-ahead").counters()
    assert ahead.commands_ahead >= 4
    kill_points = 0
    for calls in range(200):
        directory = tmp_path / f"killed-{calls}"
        with (
            loop_sizes(batch=3, step=8),
            mock.patch.object(apply_module, "carry_out", crashing_after(calls)),
        ):
            finished = _runs_to_the_end(
                Materializer(
                    "memory",
                    TOPIC,
                    directory,
                    consumer_factory=topic.consumer,
                    topic_id_reader=topic.topic_id,
                )
            )
        if finished:
            break
        kill_points += 1
        with loop_sizes(batch=3, step=8):
            resumed = materialize(topic, directory)
        assert resumed.counters().messages_routed > 0
        assert files(directory) == expected, f"killed before decision {calls}"
    assert kill_points >= 30, "every decision of the history is a kill point"


def _runs_to_the_end(materializer: Materializer) -> bool:
    """Start the materializer and wait for it to catch up or die; ``True`` when it caught up without dying."""
    try:
        materializer.start()
        caught_up = materializer.wait_until_caught_up(60)
    except Exception as exc:  # the loop died at the injected point
        assert isinstance(exc.__cause__, Crash), exc
        return False
    finally:
        materializer.stop()
    assert caught_up
    return True


@pytest.mark.parametrize("backlog", [0, 1, 250])
def test_a_freeze_answers_the_snapshot_of_its_position_whatever_the_backlog_before_it(
    backlog: int, tmp_path: Path
) -> None:
    topic = MemoryTopic(TOPIC)
    freeze_at = busy_log(topic, backlog)
    topic.publish(PutEvent(rollout_id="a", entry=make_entry("a", "late")))
    materializer = materialize(topic, tmp_path)
    result = materializer.projection.verdict_at(FreezeEvent(rollout_id="a"), LogPosition(TOPIC, 0, freeze_at))
    assert result is not None
    snapshot = materializer.store.snapshot("a", as_of=LogPosition(TOPIC, 0, freeze_at))
    # The late put was rejected after the cut and moved the version past the one the freeze answered.
    assert [e.model_call_id for e in snapshot.entries] == ["c0"]
    assert result.version == snapshot.version < materializer.store.read_state("a").version


def test_a_source_following_another_process_answers_a_command_the_checkpoint_lists_as_applied_ahead(
    tmp_path: Path,
) -> None:
    ahead = PartitionCheckpoint(TOPIC, 0, next_offset=10, commands_applied=[40])
    checkpoint_path(tmp_path, 0).write_bytes(ahead.encode())
    waiter = _CheckpointWaiter(tmp_path, TOPIC, lambda: "topic-id")

    async def waits() -> list[bool]:
        return [await waiter.applied(0, offset, 0.05, time.monotonic()) for offset in (9, 40, 12)]

    assert asyncio.run(waits()) == [True, True, False]

"""While an in-process source is answered from memory, the materializer decodes what it read before sweeping any of it.

A burst of freezes then finds its rollouts decoded, instead of each answer first decoding its rollout's puts
while the next freezes wait. Decoding first stops at a bound on the tokens it holds, and a materializer no
source is answered from (a replay) sweeps first as before. Every apply is held back here, so only the
order of the work is observed: the sweep blocks at its first apply.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

from kafka_topic_double import MemoryTopic
from store_contract import make_entry
from test_kafka_freeze_answers import TRAINER

import transports.kafka.materializer.apply_decisions as apply_module
import transports.kafka.materializer.loop as materializer_module
from tokcap.log.events import IntentEvent, PutEvent
from transports.kafka.materializer import Materializer
from transports.kafka.materializer.settings import DEFAULT_SETTINGS
from transports.kafka.wire.router import Routed

TOPIC = "tokcap.decode-first-test"


def puts_of_many_rollouts(rollouts: int = 8, calls: int = 3) -> MemoryTopic:
    topic = MemoryTopic(TOPIC)
    for call in range(calls):
        for rollout in range(rollouts):
            rollout_id = f"r{rollout}"
            topic.publish(IntentEvent(rollout_id=rollout_id, model_call_id=f"c{call}"))
            topic.publish(
                PutEvent(rollout_id=rollout_id, entry=make_entry(rollout_id, f"c{call}", tokens=50))
            )
    return topic


@contextmanager
def nothing_applied_until_released() -> Iterator[threading.Event]:
    """Hold every apply back until the test sets the event: the sweep blocks at its first one."""
    release = threading.Event()
    real = apply_module.carry_out

    def held(store: Any, topic_name: str, routed: Routed) -> Any:
        assert release.wait(60)
        return real(store, topic_name, routed)

    try:
        with mock.patch.object(apply_module, "carry_out", held):
            yield release
    finally:
        release.set()


@contextmanager
def running(materializer: Materializer) -> Iterator[Materializer]:
    materializer.start()
    try:
        yield materializer
    finally:
        materializer.stop()


def settles_within(materializer: Materializer, seconds: float) -> bool:
    """Whether the router ends with nothing left to decode within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if materializer._router.unsettled() == 0:
            return True
        time.sleep(0.01)
    return False


def test_with_a_source_answered_from_memory_everything_read_is_decoded_before_anything_is_applied(
    tmp_path: Path,
) -> None:
    topic = puts_of_many_rollouts()
    with nothing_applied_until_released() as release:
        materializer = Materializer(
            "memory", TOPIC, tmp_path, consumer_factory=topic.consumer, topic_id_reader=topic.topic_id
        )
        materializer.answer_freezes_for(TRAINER)
        with running(materializer):
            assert settles_within(materializer, 30), "the sweep went first and blocked the decoding"
            assert materializer.applied_offsets() == {0: 0}
            release.set()
            assert materializer.wait_for(0, len(topic.messages()) - 1, 60)
    assert materializer._router.decoded_ahead_tokens == 0


def test_a_materializer_no_source_is_answered_from_sweeps_first(tmp_path: Path) -> None:
    topic = puts_of_many_rollouts()
    with nothing_applied_until_released() as release:
        materializer = Materializer(
            "memory", TOPIC, tmp_path, consumer_factory=topic.consumer, topic_id_reader=topic.topic_id
        )
        with running(materializer):
            decoded_all = settles_within(materializer, 0.5)
            release.set()
    assert not decoded_all


def test_decoding_first_stops_at_its_bound_on_tokens_held(tmp_path: Path) -> None:
    topic = puts_of_many_rollouts()
    bound = mock.patch.object(
        materializer_module, "DEFAULT_SETTINGS", replace(DEFAULT_SETTINGS, decode_first_tokens=200)
    )
    with nothing_applied_until_released() as release, bound:
        materializer = Materializer(
            "memory", TOPIC, tmp_path, consumer_factory=topic.consumer, topic_id_reader=topic.topic_id
        )
        materializer.answer_freezes_for(TRAINER)
        with running(materializer):
            decoded_all = settles_within(materializer, 0.5)
            held = materializer._router.decoded_ahead_tokens
            release.set()
    assert not decoded_all
    assert 200 <= held < 200 + 150, "decoding went on past the bound (one put of 100 tokens may cross it)"

"""The materializer's apply step alone: decode each message and apply it to an empty store, in log order.

Messages are read from the topic into memory first, so the figure excludes the consumer and the broker;
they are applied through the materializer's ``Projection``, flushed after each block of the materializer's size,
with the garbage collector set as a materializer's own process sets it (``collect_less_after_start_up``).
Replay time (in ``kafka_trial``) is the end-to-end figure with the consumer.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from tokcap.files.log_projection import Projection
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import Event, LogPosition, PutEvent
from transports.kafka.cli.materializer_process import collect_less_after_start_up
from transports.kafka.materializer.settings import DEFAULT_SETTINGS
from transports.kafka.wire.codec import decode_event_value, decode_wire_delta, headers_to_dict, is_wire_delta
from transports.kafka.wire.delta_parents import ParentRestorer
from transports.kafka.wire.topic_limits import is_limits_record

__all__ = ["ApplyRate", "measure_apply_rate"]


@dataclass(frozen=True)
class ApplyRate:
    """Events and tokens applied per second by the store's apply step."""

    events: int
    tokens: int
    seconds: float
    cpu_seconds: float
    """CPU time of the thread that decoded and applied, the figure a per-event CPU target reads."""

    @property
    def events_per_s(self) -> float:
        """Events decoded and applied per second."""
        return self.events / self.seconds

    @property
    def tokens_per_s(self) -> float:
        """Tokens of applied put events per second."""
        return self.tokens / self.seconds


def _read_topic(bootstrap: str, topic: str, ends: dict[int, int]) -> list[tuple[int, int, bytes, Any, bytes]]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-apply-{topic}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        consumer.assign([TopicPartition(topic, partition, 0) for partition in ends])
        messages: list[tuple[int, int, bytes, Any, bytes]] = []
        wanted = sum(ends.values())
        while len(messages) < wanted:
            for message in consumer.consume(1000, 1.0):
                if message.error() is None:
                    messages.append(
                        (
                            int(message.partition() or 0),
                            int(message.offset() or 0),
                            message.value() or b"",
                            message.headers() or [],
                            message.key() or b"",
                        )
                    )
        return messages
    finally:
        consumer.close()


def measure_apply_rate(bootstrap: str, topic: str, ends: dict[int, int], directory: Path) -> ApplyRate:
    """Read the topic, then time decoding and applying every message to a fresh store."""
    # The topic's limits record (its first message) is read by a materializer at start, not applied.
    messages = [m for m in _read_topic(bootstrap, topic, ends) if not is_limits_record(headers_to_dict(m[3]))]
    projection = Projection(TokenCaptureStore(directory))
    # The collector set as a materializer's own process sets it after start-up; restored after the pass.
    threshold = gc.get_threshold()
    collect_less_after_start_up()
    tokens = 0
    # Wire deltas are restored as the materializer restores them, from the puts decoded before them.
    parents = ParentRestorer()
    started, cpu_started = time.perf_counter(), time.thread_time()
    for first in range(0, len(messages), DEFAULT_SETTINGS.block_messages):
        for partition, offset, value, raw_headers, key in messages[
            first : first + DEFAULT_SETTINGS.block_messages
        ]:
            headers = headers_to_dict(raw_headers)
            event: Event
            if is_wire_delta(headers):
                event = parents.restore(key, partition, offset, decode_wire_delta(key, value, headers))
            else:
                event = decode_event_value(value, headers)
                if isinstance(event, PutEvent):
                    parents.remember(key, partition, offset, event)
            projection.apply(event, LogPosition(topic, partition, offset))
            if isinstance(event, PutEvent):
                tokens += len(event.entry.prompt_token_ids) + len(event.entry.generation_token_ids)
        projection.flush()
    seconds, cpu_seconds = time.perf_counter() - started, time.thread_time() - cpu_started
    gc.unfreeze()
    gc.set_threshold(*threshold)
    return ApplyRate(len(messages), tokens, seconds, cpu_seconds)

"""The Kafka transport: sinks publish capture events, a materializer projects them, sources answer.

``transports.kafka:KafkaTokenSink`` can be named as the configured sink, with its keyword arguments
in ``sink_kwargs``. Architecture and guarantees: ``docs`` and the module docstrings here.
"""

from __future__ import annotations

from transports.kafka.materializer import Materializer
from transports.kafka.sink import KafkaTokenSink
from transports.kafka.source import KafkaTokenSource
from transports.kafka.topics import (
    MAX_TOPIC_NAME_LENGTH,
    TOPIC_PREFIX,
    TopicSettings,
    ensure_topic,
    resolve_topic,
    topic_for_run,
    validate_topic_name,
)

__all__ = [
    "MAX_TOPIC_NAME_LENGTH",
    "TOPIC_PREFIX",
    "KafkaTokenSink",
    "KafkaTokenSource",
    "Materializer",
    "TopicSettings",
    "ensure_topic",
    "resolve_topic",
    "topic_for_run",
    "validate_topic_name",
]

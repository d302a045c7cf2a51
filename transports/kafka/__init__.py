"""The Kafka transport: sinks publish capture events, a materializer projects them, sources answer.

``transports.kafka:KafkaTokenSink`` can be named as the configured sink, with its keyword arguments
in ``sink_kwargs``. Architecture and guarantees: ``docs`` and the module docstrings here.

The names below load their modules on first use: the checkpoint and dead-letter modules import no
Kafka client, and ``tokcap inspect`` reads them without the ``kafka`` extra installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transports.kafka.client.topics import (
        MAX_TOPIC_NAME_LENGTH,
        TOPIC_PREFIX,
        TopicSettings,
        ensure_topic,
        resolve_topic,
        topic_for_run,
        validate_topic_name,
    )
    from transports.kafka.materializer.loop import Materializer
    from transports.kafka.partitioned_source import PartitionedTokenSource
    from transports.kafka.sink import KafkaTokenSink
    from transports.kafka.source import KafkaTokenSource
    from transports.kafka.wire.topic_limits import TopicLimits

__all__ = [
    "MAX_TOPIC_NAME_LENGTH",
    "TOPIC_PREFIX",
    "KafkaTokenSink",
    "KafkaTokenSource",
    "Materializer",
    "PartitionedTokenSource",
    "TopicLimits",
    "TopicSettings",
    "ensure_topic",
    "resolve_topic",
    "topic_for_run",
    "validate_topic_name",
]

_MODULE_OF = {
    "Materializer": "materializer",
    "KafkaTokenSink": "sink",
    "KafkaTokenSource": "source",
    "PartitionedTokenSource": "partitioned_source",
    "TopicLimits": "wire.topic_limits",
}
"""Where each public name lives; the others are the topic helpers of ``topics``."""


def __getattr__(name: str) -> Any:
    """Import the module that defines a public name the first time it is asked for."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _MODULE_OF.get(name, "client.topics")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

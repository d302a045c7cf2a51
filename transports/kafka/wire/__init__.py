"""What a Kafka message means, decided without I/O: codec, deltas, routing, limits, partitioning, redaction.

Nothing here imports confluent-kafka or touches a file; every reader and writer learns a topic's limits
from ``topic_limits.TopicLimits``.
"""

__all__: list[str] = []

"""The Kafka commands of ``tokcap``; ``tokcap.cli.app`` mounts them with ``mount``.

Importing this package loads no Kafka client: each command imports it when it runs.
"""

from __future__ import annotations

from transports.kafka.cli.commands import KafkaCommandLine, mount

__all__ = ["KafkaCommandLine", "mount"]

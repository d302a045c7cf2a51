"""Where a materializer's loop stands, as a metrics scrape or a health check reads it from another thread.

Per partition: the next offset applied and durable, the log's end as the consumer last saw it, the age of the
oldest message read and not applied, and how long ago the checkpoint last moved.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from confluent_kafka import Consumer, KafkaException, TopicPartition

from tokcap.metrics import LoopStatus, PartitionStatus
from transports.kafka.materializer.block_checkpoints import BlockCheckpoints
from transports.kafka.materializer.partition_progress import PartitionProgress
from transports.kafka.materializer.schedule import Scheduler

__all__ = ["cached_end", "loop_status_of"]


def loop_status_of(
    topic: str,
    *,
    running: bool,
    failed: BaseException | None,
    ends: Mapping[int, int | None],
    progress: Mapping[int, PartitionProgress],
    schedule: Scheduler,
    checkpoints: BlockCheckpoints,
    kept_tokens: int,
) -> LoopStatus:
    """The loop's status from its parts; ``ends`` are the partitions' cached log ends (``cached_end``)."""
    now = time.monotonic()
    applied = checkpoints.applied_offsets()
    failure = None if failed is None else str(failed) or type(failed).__name__
    partitions = []
    for partition, held in list(progress.items()):
        oldest = schedule.oldest_timestamp_ms(partition)
        partitions.append(
            PartitionStatus(
                topic=topic,
                partition=partition,
                applied_next=applied.get(partition, held.checkpoint.next_offset),
                high_watermark=ends.get(partition),
                oldest_unapplied_age_s=0.0 if oldest is None else max(0.0, time.time() - oldest / 1000),
                checkpoint_age_s=checkpoints.age_s(partition, now),
            )
        )
    return LoopStatus(
        topic=topic,
        running=running and failure is None,
        failure=failure,
        partitions=partitions,
        rollouts_held=schedule.rollouts_held(),
        messages_held=schedule.held_messages,
        kept_tokens=kept_tokens,
    )


def cached_end(consumer: Consumer, topic: str, partition: int) -> int | None:
    """The partition's end as the consumer last saw it in a fetch; ``None`` before any fetch.

    A cached read sends no request, so nothing is translated: a failure (a partition the handle does not know
    yet, a consumer closing) only means the end is not known now, and the scrape reports no lag.
    """
    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
    except (KafkaException, RuntimeError):
        return None
    return int(high) if high is not None and high >= 0 else None

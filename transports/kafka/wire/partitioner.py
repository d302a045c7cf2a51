"""Which partition a rollout's messages land on, computed exactly as the producer computes it.

Every tokcap producer keys its messages by the rollout id and leaves the choice of partition to
librdkafka's partitioner (``producer_bridge`` sets none, so librdkafka's default ``consistent_random``
applies). A source that must find the materializer owning a rollout computes the same partition before
it publishes anything. librdkafka's keyed partitioners are:

- ``consistent`` / ``consistent_random`` (the default): CRC-32 of the key, modulo the partition count;
- ``murmur2`` / ``murmur2_random`` (the Java client's default): murmur2 of the key with the sign bit cleared,
  modulo the partition count;
- ``fnv1a`` / ``fnv1a_random``: 32-bit FNV-1a of the key read as a signed integer, C remainder, made positive.

The ``_random`` variants differ only for empty keys, which a rollout id never is. ``random`` ignores the key,
so no reader could find a rollout's partition: it is refused. ``tests/integration/test_kafka_partitioner.py``
checks every one against the partitions a real broker reported for real produces.

This module imports no Kafka client.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

from tokcap.errors import ConfigError
from tokcap.log.rollout_ids import validate_rollout_id

__all__ = [
    "DEFAULT_PARTITIONER",
    "PARTITIONERS",
    "partition_of_key",
    "partition_of_rollout",
    "partitioner_of",
]

DEFAULT_PARTITIONER = "consistent_random"
"""librdkafka's default, which every tokcap producer uses unless its ``producer_config`` names another."""

_MASK32 = 0xFFFFFFFF


def _crc32(key: bytes) -> int:
    return zlib.crc32(key)


def _murmur2(key: bytes) -> int:
    """The Java client's murmur2 (seed 0x9747b28c) with the sign bit cleared, as librdkafka's partitioner uses it."""
    m, r = 0x5BD1E995, 24
    length = len(key)
    h = (0x9747B28C ^ length) & _MASK32
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(key[i : i + 4], "little")
        k = (k * m) & _MASK32
        k ^= k >> r
        k = (k * m) & _MASK32
        h = ((h * m) & _MASK32) ^ k
    tail = key[whole:]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * m) & _MASK32
    h ^= h >> 13
    h = (h * m) & _MASK32
    h ^= h >> 15
    return h & 0x7FFFFFFF


def _fnv1a_signed(key: bytes) -> int:
    """32-bit FNV-1a read as a signed integer: librdkafka takes its C remainder and then the absolute value."""
    h = 0x811C9DC5
    for byte in key:
        h = ((h ^ byte) * 0x01000193) & _MASK32
    return h - (1 << 32) if h >= 1 << 31 else h


def _by_remainder(hash_of: Callable[[bytes], int]) -> Callable[[bytes, int], int]:
    def partition(key: bytes, count: int) -> int:
        value = hash_of(key)
        # C's remainder keeps the dividend's sign; Python's % does not, so take it on the absolute value.
        return abs(value) % count

    return partition


PARTITIONERS: Mapping[str, Callable[[bytes, int], int]] = {
    "consistent": _by_remainder(_crc32),
    "consistent_random": _by_remainder(_crc32),
    "murmur2": _by_remainder(_murmur2),
    "murmur2_random": _by_remainder(_murmur2),
    "fnv1a": _by_remainder(_fnv1a_signed),
    "fnv1a_random": _by_remainder(_fnv1a_signed),
}
"""librdkafka's keyed partitioners by their ``partitioner`` setting: ``(key, partition count) -> partition``."""


def partitioner_of(producer_config: Mapping[str, Any] | None) -> str:
    """The partitioner a producer built with this ``producer_config`` uses; one that ignores keys is refused."""
    name = str((producer_config or {}).get("partitioner", DEFAULT_PARTITIONER))
    if name not in PARTITIONERS:
        raise ConfigError(
            f"partitioner {name!r} does not place a rollout by its key, so no source could find the materializer "
            f"that owns it; use one of {sorted(PARTITIONERS)} (the default is {DEFAULT_PARTITIONER!r})"
        )
    return name


def partition_of_key(key: bytes, partition_count: int, partitioner: str = DEFAULT_PARTITIONER) -> int:
    """The partition librdkafka's ``partitioner`` sends a message with this non-empty key to."""
    if partition_count < 1:
        raise ConfigError(f"a topic has at least one partition, got {partition_count}")
    if not key:
        raise ConfigError("an empty key has no fixed partition; tokcap keys every message by its rollout id")
    if partitioner not in PARTITIONERS:
        partitioner_of({"partitioner": partitioner})
    return PARTITIONERS[partitioner](key, partition_count)


def partition_of_rollout(
    rollout_id: str, partition_count: int, partitioner: str = DEFAULT_PARTITIONER
) -> int:
    """The partition every message of this rollout lands on: its id, UTF-8 encoded, is the key."""
    return partition_of_key(validate_rollout_id(rollout_id).encode(), partition_count, partitioner)

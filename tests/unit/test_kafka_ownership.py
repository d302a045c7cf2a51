"""Owner records, the owner lookup across directories, the worker split and the partitioner's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokcap.errors import ConfigError, InvalidInputError
from transports.kafka.errors import PartitionOwnerMissingError, PartitionOwnershipConflictError
from transports.kafka.materializer.ownership import (
    PartitionOwners,
    owned_partitions,
    owner_record_path,
    write_owner_records,
)
from transports.kafka.materializer.workers import split_partitions
from transports.kafka.wire.partitioner import partition_of_key, partitioner_of


def test_owner_records_hold_only_the_topic_and_partition_so_every_run_writes_the_same_bytes(
    tmp_path: Path,
) -> None:
    (tmp_path / "a").mkdir()
    write_owner_records(tmp_path / "a", "t", [0, 2])
    (tmp_path / "b").mkdir()
    write_owner_records(tmp_path / "b", "t", [2])
    write_owner_records(tmp_path / "b", "t", [0])
    for partition in (0, 2):
        first = owner_record_path(tmp_path / "a", partition).read_bytes()
        assert first == owner_record_path(tmp_path / "b", partition).read_bytes()
        assert first == b'{"partition":%d,"topic":"t"}\n' % partition
    assert owned_partitions(tmp_path / "a", "t") == {0, 2}


def test_records_of_another_topic_and_a_missing_directory_own_nothing(tmp_path: Path) -> None:
    write_owner_records(tmp_path, "other", [0, 1])
    assert owned_partitions(tmp_path, "t") == set()
    assert owned_partitions(tmp_path / "absent", "t") == set()


def test_two_directories_owning_one_partition_are_refused_naming_both(tmp_path: Path) -> None:
    for name, partitions in (("a", [0, 1]), ("b", [1, 2])):
        (tmp_path / name).mkdir()
        write_owner_records(tmp_path / name, "t", partitions)
    with pytest.raises(
        PartitionOwnershipConflictError, match=r"partition 1 of 't' is owned by both .*a and .*b"
    ):
        PartitionOwners.under("t", tmp_path)


def test_a_partition_nobody_owns_is_looked_for_again_and_then_named_in_the_error(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    write_owner_records(tmp_path / "a", "t", [0])
    owners = PartitionOwners("t", [tmp_path / "a", tmp_path / "b"])
    assert owners.owner_of(0) == tmp_path / "a"
    with pytest.raises(
        PartitionOwnerMissingError, match=r"no materializer owns partition 1 of 't' in .*a, .*b"
    ):
        owners.owner_of(1)
    # A materializer started after the source is found on the next lookup.
    (tmp_path / "b").mkdir()
    write_owner_records(tmp_path / "b", "t", [1])
    assert owners.owner_of(1) == tmp_path / "b"


def test_workers_get_disjoint_subsets_that_cover_every_partition() -> None:
    subsets = split_partitions([5, 0, 3, 1, 2, 4, 3], 4)
    assert subsets == [[0, 4], [1, 5], [2], [3]]
    assert sorted(p for subset in subsets for p in subset) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(("workers", "fragment"), [(0, "at least 1"), (3, "more than the 2 partitions")])
def test_impossible_worker_counts_are_refused(workers: int, fragment: str) -> None:
    with pytest.raises(InvalidInputError, match=fragment):
        split_partitions([0, 1], workers)


def test_a_partitioner_that_ignores_the_key_is_refused_since_no_source_could_find_the_rollout() -> None:
    assert partitioner_of(None) == "consistent_random"
    with pytest.raises(ConfigError, match="partitioner 'random' does not place a rollout by its key"):
        partitioner_of({"partitioner": "random"})
    with pytest.raises(ConfigError, match="empty key"):
        partition_of_key(b"", 3)

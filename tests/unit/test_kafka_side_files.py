"""The materializer's side files are named in one place each and readable without the Kafka client."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokcap.cli.inspect import describe_store
from tokcap.errors import StoreCorruptionError
from transports.kafka.cli.side_files import describe_side_files
from transports.kafka.materializer.checkpoint import PartitionCheckpoint, applied_next_offset, checkpoint_path


def test_the_applied_offset_of_a_directory_is_its_checkpoints_next_offset_and_zero_before_one(
    tmp_path: Path,
) -> None:
    assert applied_next_offset(tmp_path, "tokcap.t", 0) == 0
    checkpoint_path(tmp_path, 0).write_bytes(PartitionCheckpoint("tokcap.t", 0, next_offset=17).encode())
    assert applied_next_offset(tmp_path, "tokcap.t", 0) == 17


def test_inspect_names_a_damaged_side_file_instead_of_failing_without_its_name(tmp_path: Path) -> None:
    (tmp_path / "kafka-owner-p2.json").write_bytes(b"{not json")
    with pytest.raises(StoreCorruptionError, match=r"kafka-owner-p2\.json is not valid JSON"):
        describe_store(tmp_path, describe_side_files)

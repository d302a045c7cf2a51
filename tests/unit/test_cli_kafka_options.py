"""What the Kafka commands accept on the command line, and the one-line errors for what they refuse."""

from __future__ import annotations

import pytest

from tokcap.errors import InvalidInputError
from transports.kafka.cli.options import parse_key_values, parse_offsets, parse_partitions, resolve_run_topic


def test_client_settings_keep_their_values_as_strings_and_split_at_the_first_equals_sign() -> None:
    settings = parse_key_values(["security.protocol=SSL", " sasl.password = a=b "], "-X")
    assert settings == {"security.protocol": "SSL", "sasl.password": " a=b "}


@pytest.mark.parametrize("item", ["no-separator", "=value", "  =value"])
def test_a_client_setting_without_a_key_is_refused_naming_its_option(item: str) -> None:
    with pytest.raises(InvalidInputError, match=r"--config .* must look like KEY=VALUE"):
        parse_key_values([item], "--config")


def test_partitions_are_deduplicated_and_sorted_and_none_means_all() -> None:
    assert parse_partitions("2, 0,2,") == [0, 2]
    assert parse_partitions(None) is None


def test_partitions_take_inclusive_ranges_mixed_with_numbers() -> None:
    assert parse_partitions("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_partitions("4-4, 2") == [2, 4]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("a,b", "comma-separated partition numbers"),
        (",", "0 or above"),
        ("-1,2", "0 or above"),
        ("3-1", "running backwards"),
        ("1-x", "or ranges"),
    ],
)
def test_impossible_partitions_are_refused(text: str, fragment: str) -> None:
    with pytest.raises(InvalidInputError, match=fragment):
        parse_partitions(text)


def test_until_end_means_no_limit_and_offsets_map_partitions_to_the_first_offset_not_applied() -> None:
    assert parse_offsets(" END ") is None
    assert parse_offsets("0:120, 1:98") == {0: 120, 1: 98}


@pytest.mark.parametrize("text", ["0", "0:x", "zero:1", "0:1,1"])
def test_a_malformed_until_is_refused_with_an_example(text: str) -> None:
    with pytest.raises(InvalidInputError, match=r"must be 'end' or PARTITION:OFFSET.*e\.g\. 0:120,1:98"):
        parse_offsets(text)


def test_a_negative_until_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="negative partition or offset"):
        parse_offsets("0:-1")


def test_a_run_names_its_topic_and_exactly_one_of_run_or_topic_is_required() -> None:
    assert resolve_run_topic("exp-7", None) == "tokcap.exp-7"
    assert resolve_run_topic(None, "my-topic") == "my-topic"
    for run_id, topic in ((None, None), ("exp-7", "my-topic")):
        with pytest.raises(InvalidInputError, match="exactly one of --run"):
            resolve_run_topic(run_id, topic)

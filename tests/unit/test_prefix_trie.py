"""The token trie finds the longest stored prefix, exactly as a brute-force search would."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcap.prefix_trie import PrefixTrie

token_lists = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12)


def brute_force_longest(
    stored: list[tuple[list[int], int]], query: list[int]
) -> tuple[int, list[int]] | None:
    matches = [(len(seq), value) for seq, value in stored if query[: len(seq)] == seq]
    if not matches:
        return None
    length = max(length for length, _ in matches)
    return length, [value for seq_length, value in matches if seq_length == length]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), token_lists), min_size=1, max_size=40))
def test_longest_prefix_agrees_with_brute_force_under_any_interleaving(
    operations: list[tuple[bool, list[int]]],
) -> None:
    trie: PrefixTrie[int] = PrefixTrie()
    stored: list[tuple[list[int], int]] = []
    for index, (is_insert, tokens) in enumerate(operations):
        if is_insert:
            trie.insert(tokens, index)
            stored.append((tokens, index))
        else:
            match = trie.longest_prefix(tokens)
            expected = brute_force_longest(stored, tokens)
            got = None if match is None else (match.length, list(match.values))
            assert got == expected


def test_an_equal_sequence_counts_as_a_prefix_and_reports_every_value() -> None:
    trie: PrefixTrie[str] = PrefixTrie()
    trie.insert([1, 2], "a")
    trie.insert([1, 2], "b")
    match = trie.longest_prefix([1, 2])
    assert match is not None
    assert (match.length, match.values) == (2, ["a", "b"])


def test_a_query_that_extends_nothing_stored_has_no_match() -> None:
    trie: PrefixTrie[str] = PrefixTrie()
    trie.insert([1, 2, 3], "a")
    assert trie.longest_prefix([1, 2]) is None
    assert trie.longest_prefix([2, 1, 2, 3]) is None


def test_an_empty_sequence_cannot_be_stored() -> None:
    with pytest.raises(ValueError, match="empty token sequence"):
        PrefixTrie[str]().insert([], "a")

"""A token trie that answers "which stored sequence is the longest prefix of this one?".

The trie is path-compressed: each node holds a run of tokens (a list), marks at the depths where a
stored sequence ends, and branches keyed by ``(offset, token)`` where another sequence leaves the run.
A branch never splits the run, so a long agent chain stays one node however many retries branch off it.
Runs are compared with list slices, so matching a sequence costs one C-level comparison per node
visited plus a binary search on a mismatch, and a walk visits at most one node per divergence.
Every walk is a loop, never a recursion, so a chain of any depth is safe.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from typing import Generic, TypeVar

__all__ = ["PrefixMatch", "PrefixTrie"]

ValueT = TypeVar("ValueT")


def _common_prefix_length(sequence: list[int], start: int, run: list[int]) -> int:
    """How many tokens of ``run`` equal ``sequence`` from ``start`` on."""
    limit = min(len(sequence) - start, len(run))
    if limit == 0:
        return 0
    if sequence[start : start + limit] == (run if limit == len(run) else run[:limit]):
        return limit
    low, high = 0, limit  # tokens [0, low) match; the prefix of length high does not
    while high - low > 1:
        middle = (low + high) // 2
        if sequence[start + low : start + middle] == run[low:middle]:
            low = middle
        else:
            high = middle
    return low


def _as_list(sequence: Sequence[int]) -> list[int]:
    """Slices of lists compare in C; other sequences are copied once."""
    return sequence if isinstance(sequence, list) else list(sequence)


class _RunNode(Generic[ValueT]):
    """A run of tokens starting at absolute depth ``depth``, with the sequences that end inside it."""

    __slots__ = ("branches", "depth", "mark_depths", "marks", "tokens")

    def __init__(self, depth: int, tokens: list[int]) -> None:
        self.depth = depth
        self.tokens = tokens
        self.branches: dict[tuple[int, int], _RunNode[ValueT]] = {}
        self.mark_depths: list[int] = []
        self.marks: dict[int, list[ValueT]] = {}

    def add_mark(self, depth: int, value: ValueT) -> None:
        if depth not in self.marks:
            insort(self.mark_depths, depth)
            self.marks[depth] = []
        self.marks[depth].append(value)


class PrefixMatch(Generic[ValueT]):
    """The longest stored sequence that is a prefix of a query: its length and every value stored there."""

    __slots__ = ("length", "values")

    def __init__(self, length: int, values: list[ValueT]) -> None:
        self.length = length
        self.values = values


class _Hop(Generic[ValueT]):
    """One node visited by the last walk: where it was entered, and the best match found before it."""

    __slots__ = ("best_before", "node", "start")

    def __init__(self, node: _RunNode[ValueT], start: int, best_before: PrefixMatch[ValueT] | None) -> None:
        self.node = node
        self.start = start
        self.best_before = best_before


class PrefixTrie(Generic[ValueT]):
    """Stores token sequences with values; finds the longest stored prefix of a query.

    Several values may be stored under the same sequence; a match returns all of them,
    so the caller can see that the answer is ambiguous.
    Cost is linear in the tokens of the query or the inserted sequence.

    The trie remembers the nodes its last walk visited.
    Runs are never split and branches never removed, so the node reached by a prefix never changes;
    a walk that shares a prefix with the previous one resumes at the deepest node that prefix reaches.
    That keeps a long conversation, where each call extends the previous one, at a few node visits per call
    even when every turn branches off retries.
    A new mark on a visited node forgets the visits after it, whose remembered best match could be stale.
    """

    def __init__(self) -> None:
        self._root: _RunNode[ValueT] = _RunNode(0, [])
        self._last_sequence: list[int] = []
        self._hops: list[_Hop[ValueT]] = []
        self._hop_starts: list[int] = []
        self._hop_index: dict[int, int] = {}

    def _forget_hops_from(self, index: int) -> None:
        for hop in self._hops[index:]:
            del self._hop_index[id(hop.node)]
        del self._hops[index:]
        del self._hop_starts[index:]

    def _remember_hop(self, node: _RunNode[ValueT], start: int, best: PrefixMatch[ValueT] | None) -> None:
        self._hop_index[id(node)] = len(self._hops)
        self._hops.append(_Hop(node, start, best))
        self._hop_starts.append(start)

    def _resume_point(self, sequence: list[int]) -> tuple[_RunNode[ValueT], int, PrefixMatch[ValueT] | None]:
        """The deepest remembered node that ``sequence`` enters the same way the last walk did."""
        shared = _common_prefix_length(sequence, 0, self._last_sequence)
        index = bisect_left(self._hop_starts, shared) - 1
        if index < 0:
            self._forget_hops_from(0)
            return self._root, 0, None
        hop = self._hops[index]
        self._forget_hops_from(index)
        return hop.node, hop.start, hop.best_before

    def _walk(self, sequence: list[int]) -> tuple[_RunNode[ValueT], int, int, PrefixMatch[ValueT] | None]:
        """Follow ``sequence`` as far as the trie goes: (last node, its start, tokens matched in it, best match)."""
        node, start, best = self._resume_point(sequence)
        self._last_sequence = list(sequence)
        while True:
            self._remember_hop(node, start, best)
            matched = _common_prefix_length(sequence, start, node.tokens)
            reach = start + matched
            position = bisect_right(node.mark_depths, reach)
            if position:
                depth = node.mark_depths[position - 1]
                best = PrefixMatch(depth, node.marks[depth])
            if reach == len(sequence):
                return node, start, matched, best
            branch = node.branches.get((matched, sequence[reach]))
            if branch is None:
                return node, start, matched, best
            node, start = branch, reach

    def _add_mark(self, node: _RunNode[ValueT], depth: int, value: ValueT) -> None:
        node.add_mark(depth, value)
        index = self._hop_index.get(id(node))
        if index is not None:
            self._forget_hops_from(index + 1)

    def insert(self, sequence: Sequence[int], value: ValueT) -> None:
        """Store ``value`` under ``sequence``; an empty sequence is refused (it is a prefix of everything)."""
        if not sequence:
            raise ValueError("cannot store an empty token sequence in the prefix trie")
        sequence = _as_list(sequence)
        node, start, matched, best = self._walk(sequence)
        reach = start + matched
        if reach < len(sequence):
            if matched == len(node.tokens):
                node.tokens.extend(sequence[reach:])
            else:
                branch: _RunNode[ValueT] = _RunNode(reach, sequence[reach:])
                node.branches[(matched, sequence[reach])] = branch
                node = branch
                self._remember_hop(node, reach, best)
        self._add_mark(node, len(sequence), value)

    def longest_prefix(self, sequence: Sequence[int]) -> PrefixMatch[ValueT] | None:
        """The longest stored sequence that is a prefix of ``sequence`` (or equal to it), if any."""
        return self._walk(_as_list(sequence))[3]

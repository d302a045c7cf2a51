"""Faults of engine-side staging on the file transport: what is on disk is damaged. A damaged rollout is masked
by ``finalize_rollout``, never delivered. Killing the processes that write and read it is
``tests/process/test_staging_kills.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from staging_calls import commit_for, conversation, cumulative_tokens
from staging_delivery import finalized

from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink


def _staged_rollout(root: Path, rollout_id: str, turns: int = 4) -> None:
    sink, ledger = FileStagingSink(root), FileLineageResolver(root)
    for turn in conversation(rollout_id, turns, extras=True):
        assert sink.stage(turn.call).ok
        asyncio.run(ledger.record(commit_for(turn)))


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _drop_middle(lines: list[bytes]) -> list[bytes]:
    return [*lines[:1], *lines[2:]]


def _swap_two(lines: list[bytes]) -> list[bytes]:
    return [lines[1], lines[0], *lines[2:]]


def _flip_a_digit(lines: list[bytes]) -> list[bytes]:
    line = lines[1]
    for old, new in ((b"1", b"2"), (b"2", b"3"), (b"3", b"4")):
        marker = b'"cum_len":' + old
        if marker in line:
            return [lines[0], line.replace(marker, b'"cum_len":' + new, 1), *lines[2:]]
    return [lines[0], line.replace(b"call-1", b"call-9", 1), *lines[2:]]


def _drop_last(lines: list[bytes]) -> list[bytes]:
    return lines[:-1]


def _damage_a_log_prob(lines: list[bytes]) -> list[bytes]:
    line = lines[1]
    at = line.index(b'"generation_log_probs_delta":[') + len(b'"generation_log_probs_delta":[')
    return [lines[0], line[:at] + b"-9.5," + line[at:].split(b",", 1)[1], *lines[2:]]


@pytest.mark.parametrize("suffix", [".tokens.staged", ".tokens.ledger"])
@pytest.mark.parametrize(
    "damage",
    [_drop_middle, _drop_last, _swap_two, _flip_a_digit],
    ids=["lost", "last-lost", "reordered", "corrupted"],
)
def test_a_staged_or_ledger_row_lost_reordered_or_corrupted_on_disk_masks_the_rollout_never_delivered(
    tmp_path: Path, suffix: str, damage: Callable[[list[bytes]], list[bytes]]
) -> None:
    _staged_rollout(tmp_path, "r1")
    _staged_rollout(tmp_path, "r2")
    path = tmp_path / f"r1{suffix}"
    path.write_bytes(b"".join(damage(_lines(path))))
    masked, tokens = finalized(tmp_path, "r1")
    assert masked and tokens is None
    assert finalized(tmp_path, "r2") == (
        False,
        cumulative_tokens(conversation("r2", 4, extras=True)[-1].call),
    )


def test_a_staged_log_prob_changed_on_disk_masks_the_rollout(tmp_path: Path) -> None:
    _staged_rollout(tmp_path, "r1")
    path = tmp_path / "r1.tokens.staged"
    path.write_bytes(b"".join(_damage_a_log_prob(_lines(path))))
    assert finalized(tmp_path, "r1") == (True, None)

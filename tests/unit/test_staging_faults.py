"""Faults of engine-side staging on the file transport: what is on disk is damaged, or the processes writing
and reading it are killed. A damaged rollout is masked by ``finalize_rollout``, never delivered; a call whose
``stage`` returned ok is never lost."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from staging_calls import commit_for, conversation, cumulative_tokens

from tokcap.errors import StoreCorruptionError
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, FileStagingSource, finalize_rollout

REPO = Path(__file__).resolve().parents[2]


def _staged_rollout(root: Path, rollout_id: str, turns: int = 4) -> None:
    sink, ledger = FileStagingSink(root), FileLineageResolver(root)
    for turn in conversation(rollout_id, turns, extras=True):
        assert sink.stage(turn.call).ok
        asyncio.run(ledger.record(commit_for(turn)))


def _finalized(root: Path, rollout_id: str) -> tuple[bool, list[int] | None]:
    """Whether the rollout is masked and, if delivered, its tokens; a read that refuses the files masks too."""
    try:
        manifest = asyncio.run(FileLineageResolver(root).manifest(rollout_id))
    except (StoreCorruptionError, ValueError):
        return True, None
    done = finalize_rollout(manifest, FileStagingSource(root))
    return done.masked, None if done.row is None else list(done.row.token_ids)


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
    masked, tokens = _finalized(tmp_path, "r1")
    assert masked and tokens is None
    assert _finalized(tmp_path, "r2") == (
        False,
        cumulative_tokens(conversation("r2", 4, extras=True)[-1].call),
    )


def test_a_staged_log_prob_changed_on_disk_masks_the_rollout(tmp_path: Path) -> None:
    _staged_rollout(tmp_path, "r1")
    path = tmp_path / "r1.tokens.staged"
    path.write_bytes(b"".join(_damage_a_log_prob(_lines(path))))
    assert _finalized(tmp_path, "r1") == (True, None)


_WORKER = """
import sys, time
sys.path.insert(0, {tests!r})
from staging_calls import conversation
from tokcap.staging import FileStagingSink
sink = FileStagingSink(sys.argv[1])
rollout = sys.argv[2]
for turn in conversation(rollout, 40, extras=True):
    assert sink.stage(turn.call, attachments={{"image": turn.call.digest.encode() * 3000}}).ok
    print(turn.call.model_call_id, time.monotonic(), flush=True)
"""

_TRAINER = """
import sys
from tokcap.staging import FileStagingSource
source = FileStagingSource(sys.argv[1])
keys = sys.argv[2:]
while True:
    for row in source.fetch_full(keys):
        assert row.digest
"""


def test_killing_a_staging_worker_and_the_trainer_at_random_points_loses_no_acknowledged_call(
    tmp_path: Path,
) -> None:
    """Each iteration SIGKILLs a worker at a random instant of its run and a reading trainer beside it; after
    the restart every call whose ``stage`` returned ok is fetched in full and its chain verified."""
    rng = random.Random(29)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    worker_script = _WORKER.format(tests=str(REPO / "tests"))
    acknowledged_total, lost = 0, 0
    for iteration in range(4):
        rollout = f"crash{iteration}"
        worker = subprocess.Popen(
            [sys.executable, "-c", worker_script, str(tmp_path), rollout], stdout=subprocess.PIPE, env=env
        )
        assert worker.stdout is not None
        acknowledged = [worker.stdout.readline().decode().split()[0] for _ in range(rng.randint(1, 6))]
        keys = [f"{rollout}/{call_id}" for call_id in acknowledged]
        trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(tmp_path), *keys], env=env)
        time.sleep(rng.uniform(0.0, 0.1))
        worker.send_signal(signal.SIGKILL)
        trainer.send_signal(signal.SIGKILL)
        worker.wait()
        trainer.wait()
        rest = worker.stdout.read().decode().split("\n")
        worker.stdout.close()
        acknowledged += [line.split()[0] for line in rest if line.strip()]
        turns = {turn.call.model_call_id: turn for turn in conversation(rollout, 40, extras=True)}
        source = FileStagingSource(tmp_path)
        keys = [f"{rollout}/{call_id}" for call_id in acknowledged]
        fetched = source.fetch_full(keys)
        for call_id, row in zip(acknowledged, fetched, strict=True):
            if row.model_dump() != turns[call_id].call.model_dump():
                lost += 1
            assert source.fetch_attachments(f"{rollout}/{call_id}") == {
                "image": turns[call_id].call.digest.encode() * 3000
            }
        ledger = FileLineageResolver(tmp_path)
        for call_id in acknowledged:
            asyncio.run(ledger.record(commit_for(turns[call_id])))
        masked, tokens = _finalized(tmp_path, rollout)
        assert not masked and tokens == cumulative_tokens(turns[acknowledged[-1]].call)
        last = turns["call-39"].call
        assert FileStagingSink(tmp_path).stage(last, attachments={"image": last.digest.encode() * 3000}).ok
        acknowledged_total += len(acknowledged)
    assert lost == 0 and acknowledged_total >= 4

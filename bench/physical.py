"""Physical references measured in the same run: what the disk and orjson can do alone.

The targets are ratios against these, so a slow or loaded machine moves both sides together.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.options import WorkloadShape
from bench.workload import rollouts_of, tokens_of
from tokcap.files.group_commit import filesystem_sync_for

__all__ = ["EncodeRate", "create_rate", "encode_and_write_rate", "fsync_rate", "rename_rate", "syncfs_rate"]

_LINE = b'{"model_call_id":"call-0000","op":"intent","rollout_id":"bench-reference"}\n'


def fsync_rate(directory: Path, seconds: float) -> float:
    """Appends of one short line, each followed by ``fsync``, per second, from one thread."""
    path = directory / "fsync-reference.bin"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            os.write(fd, _LINE)
            os.fsync(fd)
            count += 1
    finally:
        os.close(fd)
        path.unlink()
    return count / elapsed


def syncfs_rate(directory: Path, seconds: float) -> float:
    """Appends followed by the store's own filesystem sync (``syncfs``), per second, from one thread."""
    path = directory / "syncfs-reference.bin"
    sync = filesystem_sync_for(directory)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            os.write(fd, _LINE)
            sync()
            count += 1
    finally:
        os.close(fd)
        path.unlink()
    return count / elapsed


def rename_rate(directory: Path, seconds: float) -> float:
    """Small files written and renamed over a target (no fsync), per second: the cost of an atomic replace."""
    target = directory / "rename-reference.json"
    temp = directory / "rename-reference.json.tmp"
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        temp.write_bytes(_LINE)
        os.replace(temp, target)
        count += 1
    target.unlink()
    return count / elapsed


_MOST_CREATES = 4_000
"""Files the create reference makes at most: each one is removed with the work directory, and every removal
slows the file system's next creates."""


def create_rate(directory: Path, seconds: float) -> float:
    """New empty files created per second (no write, no fsync): what each rollout's first files cost.

    A store creates a rollout's lock, intents and entries files once, and a new temporary file for every state
    it replaces, so this rate bounds the apply step where rollouts are many and short.
    The files stay in ``directory/create-reference`` for the caller to remove after its last trial: on ext4,
    removing thousands of files slows every file create of the next half minute, so removing them here would
    slow the trials measured right after.
    """
    scratch = directory / "create-reference"
    scratch.mkdir()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds and count < _MOST_CREATES:
        os.close(os.open(scratch / f"f{count}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        count += 1
    return count / elapsed


@dataclass(frozen=True)
class EncodeRate:
    """How fast orjson alone turns a workload's entries into JSONL lines on disk."""

    entries_per_s: float
    tokens_per_s: float
    seconds: float


def encode_and_write_rate(directory: Path, shape: WorkloadShape) -> EncodeRate:
    """Encode every entry of the workload with orjson (sorted keys) and append it to its rollout's file.

    Entries are dumped to plain dicts first, untimed, so only orjson and ``write`` are measured;
    each file is fsynced once at the end, inside the timing.
    """
    entries = tokens = 0
    elapsed = 0.0
    for slot in rollouts_of(shape, "reference"):
        for rollout in slot:
            path = directory / f"{rollout.rollout_id}.reference.jsonl"
            mappings = []
            for entry in rollout.entries():
                mappings.append(entry.model_dump(mode="json"))
                tokens += tokens_of(entry)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                start = time.perf_counter()
                for mapping in mappings:
                    os.write(fd, orjson.dumps(mapping, option=orjson.OPT_SORT_KEYS) + b"\n")
                os.fsync(fd)
                elapsed += time.perf_counter() - start
            finally:
                os.close(fd)
                path.unlink()
            entries += len(mappings)
    return EncodeRate(entries / elapsed, tokens / elapsed, elapsed)

"""Several OS processes writing one store, and processes killed mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tokcap.files.store import TokenCaptureStore

WORKER = Path(__file__).resolve().parent.parent / "store_worker.py"


def _spawn(
    root: Path, worker: str, rollouts: list[str], count: int, prompt_len: int = 50
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(root), worker, ",".join(rollouts), str(count), str(prompt_len)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _assert_store_holds(root: Path, acknowledged: list[tuple[str, str]]) -> None:
    store = TokenCaptureStore(root)
    by_rollout: dict[str, list[str]] = {}
    for rollout_id in store.rollout_ids():
        entries = store.read_entries(rollout_id)
        calls = [e.model_call_id for e in entries]
        assert len(calls) == len(set(calls)), f"duplicate entry lines in {rollout_id}"
        by_rollout[rollout_id] = calls
        path = store.path_for(rollout_id)
        # A rollout whose writers were killed before its first entry has no entries file (the freeze made its state).
        raw = path.read_bytes() if path.exists() else b""
        # A writer killed between creating the file and writing its first line leaves it empty: no line, no tail.
        assert raw.count(b"\n") == len(calls) and (raw == b"" or raw.endswith(b"\n"))
    for rollout_id, call_id in acknowledged:
        assert call_id in by_rollout.get(rollout_id, []), f"acknowledged {call_id} lost from {rollout_id}"


def test_processes_writing_the_same_and_different_rollouts_lose_and_tear_nothing(tmp_path: Path) -> None:
    workers = [
        _spawn(tmp_path, "a", ["shared", "only-a"], 60),
        _spawn(tmp_path, "b", ["shared", "only-b"], 60),
        _spawn(tmp_path, "c", ["shared"], 60),
    ]
    acknowledged: list[tuple[str, str]] = []
    for worker in workers:
        out, _ = worker.communicate(timeout=300)
        assert worker.returncode == 0
        acknowledged += [tuple(line.split()) for line in out.splitlines()]  # type: ignore[misc]
    assert len(acknowledged) == 180
    _assert_store_holds(tmp_path, acknowledged)
    assert len(TokenCaptureStore(tmp_path).read_entries("shared")) == 30 + 30 + 60


def _read_acks(worker: subprocess.Popen[str], count: int) -> list[tuple[str, str]]:
    """Block until the worker has reported ``count`` acknowledged entries (or ended early)."""
    assert worker.stdout is not None
    acknowledged: list[tuple[str, str]] = []
    while len(acknowledged) < count:
        line = worker.stdout.readline()
        if not line:
            break
        rollout_id, call_id = line.split()
        acknowledged.append((rollout_id, call_id))
    return acknowledged


@pytest.mark.parametrize("acks_before_kill", [1, 20, 60])
def test_a_writer_killed_mid_put_leaves_every_acknowledged_entry_readable(
    tmp_path: Path, acks_before_kill: int
) -> None:
    """Each writer is killed after it reported this many acknowledgements, while it is writing more."""
    workers = [_spawn(tmp_path, f"w{n}", ["r1", "r2"], 100_000, prompt_len=3000) for n in range(2)]
    acknowledged: list[tuple[str, str]] = []
    for worker in workers:
        before_kill = _read_acks(worker, acks_before_kill)
        assert len(before_kill) == acks_before_kill, "a writer ended before acknowledging enough entries"
        acknowledged += before_kill
    for worker in workers:
        os.kill(worker.pid, signal.SIGKILL)
    for worker in workers:
        out, _ = worker.communicate(timeout=60)
        assert worker.returncode == -signal.SIGKILL
        acknowledged += [tuple(line.split()) for line in out.splitlines()]  # type: ignore[misc]
    assert len(acknowledged) >= 2 * acks_before_kill
    store = TokenCaptureStore(tmp_path)
    # A kill can leave a torn, never acknowledged last line; the next writer's recovery cuts it. The freeze is
    # that writer, so the raw files are checked after it.
    snapshots = {rollout_id: store.freeze_now(rollout_id) for rollout_id in ("r1", "r2")}
    _assert_store_holds(tmp_path, acknowledged)
    for rollout_id, snapshot in snapshots.items():
        assert {e.model_call_id for e in snapshot.entries} >= {c for r, c in acknowledged if r == rollout_id}
        assert store.drop_now(rollout_id, snapshot.snapshot_id, snapshot.version)

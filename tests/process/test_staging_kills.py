"""Killing the processes that stage and read rollouts on the file transport loses no call whose ``stage``
returned ok."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from staging_calls import commit_for, conversation, cumulative_tokens
from staging_delivery import finalized

from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, FileStagingSource

REPO = Path(__file__).resolve().parents[2]


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
        masked, tokens = finalized(tmp_path, rollout)
        assert not masked and tokens == cumulative_tokens(turns[acknowledged[-1]].call)
        last = turns["call-39"].call
        assert FileStagingSink(tmp_path).stage(last, attachments={"image": last.digest.encode() * 3000}).ok
        acknowledged_total += len(acknowledged)
    assert lost == 0 and acknowledged_total >= 4

"""Engine-side staging on the file store seen from other processes: a row staged ok is read by another process,
the conformance kit runs without Gym loaded, and a worker killed the instant ``stage`` returned ok loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from staging_calls import commit_for, conversation, cumulative_tokens, staged_call

from tokcap.staging import FileStagingSink, FileStagingSource

REPO = Path(__file__).resolve().parents[2]


def test_a_row_staged_ok_is_fetchable_by_a_source_in_another_process(tmp_path: Path) -> None:
    call = staged_call("r1", "c0", [1, 2], [3])
    assert FileStagingSink(tmp_path).stage(call, attachments={"a": b"\x00\x01"}).ok
    script = (
        "import sys; from tokcap.staging import FileStagingSource as S; s = S(sys.argv[1]);"
        "[r] = s.fetch(['r1/c0']); print(r.digest, s.fetch_attachments('r1/c0')['a'].hex())"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert out.stdout.split() == [call.digest, "0001"], out.stderr


def test_the_staging_conformance_kit_passes_without_gym_on_tokcaps_own_classes(tmp_path: Path) -> None:
    script = (
        "import asyncio, sys\n"
        "from tokcap.lineage import FileLineageResolver as L\n"
        "from tokcap.staging import FileStagingSink as K, FileStagingSource as S\n"
        "from tokcap.staging.conformance import run_staging_conformance as run\n"
        "root = sys.argv[1]\n"
        "print(len(asyncio.run(run(lambda: K(root), lambda: S(root), lambda: L(root)))))\n"
        "print('nemo_gym' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert out.stdout.split() == ["9", "False"], out.stderr[-3000:]


def test_a_worker_killed_the_instant_stage_returned_ok_leaves_every_acknowledged_row_fetchable_and_verifiable(
    tmp_path: Path,
) -> None:
    import signal

    from tokcap.staging import verify_and_linearize
    from tokcap.staging.records import RolloutReceipt

    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "from staging_calls import conversation\n"
        "from tokcap.staging import FileStagingSink\n"
        "sink = FileStagingSink(sys.argv[1])\n"
        "for turn in conversation('killed', 40, extras=True):\n"
        "    assert sink.stage(turn.call, attachments={'a': turn.call.digest.encode() * 5000}).ok\n"
        "    print(turn.call.model_call_id, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    worker = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    assert worker.stdout is not None
    acknowledged = [worker.stdout.readline().decode().strip() for _ in range(6)]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    worker.stdout.close()
    turns = {turn.call.model_call_id: turn for turn in conversation("killed", 40, extras=True)}
    source = FileStagingSource(tmp_path)
    keys = [f"killed/{call_id}" for call_id in acknowledged]
    assert [s.model_dump() for s in source.fetch_full(keys)] == [
        turns[c].call.model_dump() for c in acknowledged
    ]
    assert source.fetch_attachments(keys[-1]) == {"a": turns[acknowledged[-1]].call.digest.encode() * 5000}
    records = [commit_for(turns[call_id]).record for call_id in acknowledged]
    receipt = RolloutReceipt(
        rollout_id="killed",
        manifest=records,
        terminal_model_call_id=acknowledged[-1],
        terminal_selection="declared",
    )
    row = verify_and_linearize(receipt, source.fetch(keys))
    assert row.token_ids == cumulative_tokens(turns[acknowledged[-1]].call)
    later = turns["call-39"].call
    assert FileStagingSink(tmp_path).stage(later).ok

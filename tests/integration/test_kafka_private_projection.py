"""Kafka readers with no ``store_dir`` (the one block every model server reads): a ledger keeps a ledger-only
projection in a directory of its process's own, decodes no staged call, keeps none on disk, and removes the
directory at close; a resolver of puts alone never starts one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from staging_calls import assistant, commit_for, conversation, cumulative_tokens, user

from tokcap.lineage import LineageResolution
from tokcap.log.records import ParentResolutionStatus
from tokcap.staging import finalize_rollout
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.source import KafkaTokenSource
from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource
from transports.kafka.wire.router import InboundRouter

pytestmark = pytest.mark.kafka


@pytest.fixture
def private_root() -> Path:
    return Path(os.environ["TOKCAP_PRIVATE_DIR"])


def _directories(root: Path) -> list[Path]:
    return sorted(path for path in root.iterdir() if path.is_dir()) if root.exists() else []


def _bytes_under(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


@pytest.fixture
def where(kafka_bootstrap: str, kafka_topic: str) -> dict[str, Any]:
    return {"bootstrap_servers": kafka_bootstrap, "topic": kafka_topic}


@pytest.fixture
def staged_with_media(where: dict[str, Any]) -> Iterator[list[Any]]:
    """Two rollouts of three calls each, staged with 3 MiB of media per call (chunked on the wire)."""
    turns = [turn for rollout in ("media-a", "media-b") for turn in conversation(rollout, 3, extras=True)]
    sink = KafkaStagingSink(**where)
    try:
        for turn in turns:
            assert sink.stage(turn.call, attachments={"image": os.urandom(3 * 1024 * 1024)}).ok
    finally:
        sink.close()
    yield turns


def test_a_ledger_without_store_dir_keeps_no_staged_bytes_and_removes_its_directory_at_close(
    where: dict[str, Any], private_root: Path, staged_with_media: list[Any]
) -> None:
    ledger = KafkaLineageResolver(**where)
    try:
        for turn in staged_with_media:
            asyncio.run(ledger.record(commit_for(turn)))
        manifest = asyncio.run(ledger.manifest("media-a"))
        assert [row["model_call_id"] for row in manifest["records"]] == ["call-0", "call-1", "call-2"]
        assert asyncio.run(ledger.has_rows("media-b"))
        (directory,) = _directories(private_root)
        assert directory.name.startswith("ledger-tokcap-test-") and f"-{os.getpid()}-" in directory.name
        assert not list(directory.glob("*.tokens.staged"))
        # 18 MiB staged: the ledger's directory holds its rows, states and checkpoints only.
        assert _bytes_under(directory) < 256 * 1024
    finally:
        asyncio.run(ledger.close())
    assert _directories(private_root) == []
    assert list(private_root.iterdir()) == []


def test_a_ledger_only_projection_never_decodes_a_staged_call(
    where: dict[str, Any], staged_with_media: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[str | None] = []
    original = InboundRouter._decode

    def watching(self: InboundRouter, *args: Any, **kwargs: Any) -> Any:
        decided = original(self, *args, **kwargs)
        decoded.append(getattr(getattr(decided, "event", None), "type", None))
        return decided

    monkeypatch.setattr(InboundRouter, "_decode", watching)
    ledger = KafkaLineageResolver(**where)
    try:
        asyncio.run(ledger.record(commit_for(staged_with_media[0])))
        assert asyncio.run(ledger.manifest("media-a"))["records"]
    finally:
        asyncio.run(ledger.close())
    assert "ledger" in decoded
    assert "stage" not in decoded


def test_the_ledgers_of_one_process_share_one_private_directory(
    where: dict[str, Any], private_root: Path, staged_with_media: list[Any]
) -> None:
    first, second = KafkaLineageResolver(**where), KafkaLineageResolver(**where)
    try:
        asyncio.run(first.record(commit_for(staged_with_media[0])))
        assert asyncio.run(second.has_rows("media-a"))
        assert len(_directories(private_root)) == 1
        asyncio.run(first.close())
        assert asyncio.run(second.manifest("media-a"))["records"]
    finally:
        asyncio.run(first.close())
        asyncio.run(second.close())
    assert _directories(private_root) == []


def test_sources_without_store_dir_read_a_whole_projection_of_their_own_and_remove_it_at_close(
    where: dict[str, Any], private_root: Path, staged_with_media: list[Any]
) -> None:
    turns = [turn for turn in staged_with_media if turn.call.rollout_id == "media-b"]
    ledger = KafkaLineageResolver(**where)
    source = KafkaStagingSource(**where)
    commands = KafkaTokenSource(**where)
    try:
        for turn in turns:
            asyncio.run(ledger.record(commit_for(turn)))
        done = finalize_rollout(asyncio.run(ledger.manifest("media-b")), source)
        assert done.row is not None and done.row.token_ids == cumulative_tokens(turns[-1].call)
        assert len(_directories(private_root)) == 2  # the ledger's, and the sources' shared one
        assert list(asyncio.run(commands.retire(["media-b"])).removed) == ["media-b"]
        assert asyncio.run(ledger.manifest("media-b"))["records"] == []
    finally:
        source.close()
        asyncio.run(commands.close())
        asyncio.run(ledger.close())
    assert _directories(private_root) == []


def _stage_root_from_another_process(where: dict[str, Any], rollout_id: str) -> None:
    """Stage the root of ``conversation(rollout_id, 1)`` through a sink in a process of its own."""
    repo = Path(__file__).resolve().parents[2]
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(repo / 'tests')!r})\n"
        "from staging_calls import conversation\n"
        "from transports.kafka.staging import KafkaStagingSink\n"
        "sink = KafkaStagingSink(bootstrap_servers=sys.argv[1], topic=sys.argv[2])\n"
        "assert sink.stage(conversation(sys.argv[3], 1)[0].call).ok\n"
        "sink.close()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(repo)}
    command = [sys.executable, "-c", script, where["bootstrap_servers"], where["topic"], rollout_id]
    subprocess.run(command, env=env, check=True)


def test_without_store_dir_a_row_naming_a_stage_the_store_dropped_is_recorded_and_the_trainer_masks_it(
    where: dict[str, Any],
) -> None:
    """A ledger-only ledger judges a row without the staged row it names (it never read it): the conflict a whole
    projection refuses at ``record`` is caught by the trainer's verification instead, never trained on."""
    _stage_root_from_another_process(where, "dropped")
    [second] = conversation("dropped", 1, extras=True)
    sink = KafkaStagingSink(**where)
    ledger = KafkaLineageResolver(**where)
    source = KafkaStagingSource(**where)
    try:
        assert sink.stage(second.call).ok  # acknowledged, then dropped by the store: the first one stands
        asyncio.run(ledger.record(commit_for(second)))
        done = finalize_rollout(asyncio.run(ledger.manifest("dropped")), source)
        assert done.masked and done.row is None
    finally:
        sink.close()
        source.close()
        asyncio.run(ledger.close())


def test_a_resolver_of_puts_alone_starts_no_ledger(where: dict[str, Any], private_root: Path) -> None:
    resolver = KafkaLineageResolver(**where)
    try:
        request = [user("q"), assistant("a"), user("q2")]
        answer: LineageResolution = asyncio.run(resolver.resolve("puts-only", request))
        assert answer.status is ParentResolutionStatus.UNRESOLVED
    finally:
        asyncio.run(resolver.close())
    assert _directories(private_root) == []


def test_the_ledger_start_benchmark_keeps_a_ledger_only_start_free_of_the_staged_bytes(
    kafka_bootstrap: str,
) -> None:
    from bench.ledger_start import LedgerStartShape, run_ledger_start

    shape = LedgerStartShape(calls=20, attachment_bytes=64 * 1024)
    result = run_ledger_start(
        kafka_bootstrap, shape, 1, Path(os.environ["TOKCAP_PRIVATE_DIR"]), lambda _: None
    )
    medians = result["medians"]
    assert set(medians) == {
        "ledger_apart",
        "ledger_inline",
        "rows_only",
        "whole_apart",
        "whole_inline",
        "read_floor",
    }
    staged_mb = 20 * 64 * 1024 / 1e6
    assert result["topic_mb"] > staged_mb
    assert result["apart_topic_mb"] < staged_mb / 10
    for whole in ("whole_apart", "whole_inline"):
        assert medians[whole]["dir_mb"] > staged_mb
    for ledger in ("ledger_apart", "ledger_inline"):
        assert medians[ledger]["dir_mb"] < medians["whole_inline"]["dir_mb"] / 10
        assert medians[ledger]["dir_mb"] == pytest.approx(medians["rows_only"]["dir_mb"], rel=0.25)


def test_a_model_server_killed_with_its_ledger_open_leaves_a_directory_the_next_start_removes(
    where: dict[str, Any], private_root: Path
) -> None:
    script = (
        "import asyncio, sys, time\n"
        "from tokcap.files.private_dirs import private_directories\n"
        "from transports.kafka.lineage import KafkaLineageResolver\n"
        "ledger = KafkaLineageResolver(bootstrap_servers=sys.argv[1], topic=sys.argv[2])\n"
        "asyncio.run(ledger.record_failure('killed', 'call-0', 'worker_capture_failed'))\n"
        "print(*private_directories.held(), flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-c", script, where["bootstrap_servers"], where["topic"]]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as server:
        assert server.stdout is not None
        left = Path(server.stdout.readline().strip())
        server.kill()
    assert left.is_dir() and list(left.iterdir())
    ledger = KafkaLineageResolver(**where)
    try:
        assert asyncio.run(ledger.has_rows("killed"))
        (mine,) = _directories(private_root)
        assert mine != left and not left.exists()
    finally:
        asyncio.run(ledger.close())
    assert list(private_root.iterdir()) == []


def test_a_directory_projected_whole_in_this_process_is_refused_to_a_ledger_only_reader(
    where: dict[str, Any], tmp_path: Path
) -> None:
    from tokcap.errors import ConfigError
    from transports.kafka.materializer.shared_materializers import shared_materializers
    from transports.kafka.private_projection import LEDGER_SKIPPED_TYPES

    source = KafkaStagingSource(**where, store_dir=tmp_path)
    try:
        with pytest.raises(ConfigError, match="give each kind of reader a directory of its own"):
            shared_materializers.acquire(
                where["bootstrap_servers"], where["topic"], tmp_path, None, LEDGER_SKIPPED_TYPES
            )
    finally:
        source.close()

"""A staged key after a delete, a retire or nothing: the file store and Kafka answer alike, from any process.

Each case stages payload A under ``R/call-0`` and records it, then deletes the rollout, retires it, does both
or does nothing, then stages payload B under the same key from the same sink, a fresh sink in the same process, or a
sink in another process. The answer must be the same on both transports: after a delete B is staged ok and
kept; with nothing in between B is refused and A stands; after a retire B is refused by the fence. The rows
checked are the ones a fresh reader finds, so an ok whose row the materializer then refused would show.

One case cannot be answered at ``stage`` and is told later instead: a Kafka sink in another process with no
``store_dir`` has no memory and no projection, so the broker acknowledges B and the materializer refuses it.
The ledger row Gym's model server records next is refused then, before the call commits, and the rollout is
never trained on B (``docs/gym.md``, "Over Kafka").
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from staging_calls import commit_for, conversation

from tokcap.errors import ConflictingEntryError, RolloutRetiredError, StagingKeyNotFoundError
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink, FileStagingSource
from transports.kafka.lineage import KafkaLineageResolver
from transports.kafka.staging import KafkaStagingSink, KafkaStagingSource

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
ROLLOUT = "R"
KEY = f"{ROLLOUT}/call-0"

_OTHER_PROCESS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from staging_calls import conversation
transport, where, topic, store_dir = sys.argv[2:6]
if transport == "file":
    from tokcap.staging import FileStagingSink
    sink = FileStagingSink(where)
else:
    from transports.kafka.staging import KafkaStagingSink
    sink = KafkaStagingSink(bootstrap_servers=where, topic=topic, store_dir=store_dir or None)
result = sink.stage(conversation(sys.argv[6], 1, extras=True)[0].call)
if transport != "file":
    sink.close()
print(json.dumps({"ok": result.ok, "error": result.error}))
"""


class _Run:
    """One transport's sinks, ledger and reader for a case."""

    def __init__(self, transport: str, tmp_path: Path, bootstrap: str, topic: str) -> None:
        self.transport, self.tmp_path, self.bootstrap, self.topic = transport, tmp_path, bootstrap, topic
        self.root = tmp_path / "store"
        self.sinks: list[Any] = []
        self.ledger: Any = (
            FileLineageResolver(self.root)
            if transport == "file"
            else KafkaLineageResolver(bootstrap_servers=bootstrap, topic=topic, store_dir=tmp_path / "ledger")
        )

    @property
    def store_dir(self) -> Path | None:
        return self.tmp_path / "sink" if self.transport == "kafka+store_dir" else None

    def sink(self) -> Any:
        sink: Any = (
            FileStagingSink(self.root)
            if self.transport == "file"
            else KafkaStagingSink(
                bootstrap_servers=self.bootstrap, topic=self.topic, store_dir=self.store_dir
            )
        )
        self.sinks.append(sink)
        return sink

    def stage_from_another_process(self) -> dict[str, Any]:
        where = str(self.root) if self.transport == "file" else self.bootstrap
        other_dir = "" if self.store_dir is None else str(self.tmp_path / "other-process")
        argv = [str(REPO / "tests"), self.transport, where, self.topic, other_dir, ROLLOUT]
        completed = subprocess.run(
            [sys.executable, "-c", _OTHER_PROCESS, *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=False,
        )
        assert completed.returncode == 0, completed.stderr
        answer: dict[str, Any] = json.loads(completed.stdout.strip().splitlines()[-1])
        return answer

    def kept_row(self) -> Any:
        """The row a reader that never staged anything finds under the key, or ``None``."""
        source: Any = (
            FileStagingSource(self.root)
            if self.transport == "file"
            else KafkaStagingSource(
                bootstrap_servers=self.bootstrap, topic=self.topic, store_dir=self.tmp_path / "reader"
            )
        )
        try:
            [row] = source.fetch_full([KEY])
            return row.model_dump()
        except StagingKeyNotFoundError:
            return None
        finally:
            if self.transport != "file":
                source.close()

    def close(self) -> None:
        for sink in self.sinks:
            if self.transport != "file":
                sink.close()
        if self.transport != "file":
            asyncio.run(self.ledger.close())


TRANSPORTS = ["file", "kafka", "kafka+store_dir"]
STAGERS = ["same sink", "fresh sink", "other process"]

# (between, transport, stager) -> (ok, fragment of the error, row kept: "A", "B" or None). Unlisted cases
# expect the answer of their "between" row.
EXPECTED: dict[str, tuple[bool, str | None, str | None]] = {
    "delete": (True, None, "B"),
    "nothing": (False, "already staged with a different payload", "A"),
    "retire": (False, "is retired; its fence refused the stage", None),
    "retire, then delete": (True, None, "B"),
}
TOLD_AT_THE_LEDGER = {("nothing", "kafka", "other process"), ("retire", "kafka", "other process")}


@pytest.mark.parametrize("stager", STAGERS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("between", list(EXPECTED))
def test_a_staged_key_is_free_again_after_a_delete_and_refused_otherwise_on_both_transports_from_any_process(
    between: str, transport: str, stager: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    bootstrap = "" if transport == "file" else str(request.getfixturevalue("kafka_bootstrap"))
    topic = "" if transport == "file" else request.getfixturevalue("kafka_topic_factory").staged_apart()
    [first] = conversation(ROLLOUT, 1)
    [second] = conversation(ROLLOUT, 1, extras=True)
    rows = {"A": first.call.model_dump(), "B": second.call.model_dump(), None: None}
    run = _Run(transport, tmp_path, bootstrap, topic)
    try:
        sink = run.sink()
        assert sink.stage(first.call).ok
        asyncio.run(run.ledger.record(commit_for(first)))
        if "retire" in between:
            assert asyncio.run(run.ledger.retire([ROLLOUT])) == {"removed": [ROLLOUT], "absent": []}
        if "delete" in between:
            assert asyncio.run(run.ledger.delete([ROLLOUT])) == {"removed": [ROLLOUT], "absent": []}
        if stager == "same sink":
            result = sink.stage(second.call)
            answer = {"ok": result.ok, "error": result.error}
        elif stager == "fresh sink":
            result = run.sink().stage(second.call)
            answer = {"ok": result.ok, "error": result.error}
        else:
            answer = run.stage_from_another_process()
        kept = run.kept_row()
        if (between, transport, stager) in TOLD_AT_THE_LEDGER:
            # Acknowledged by the broker, refused by the materializer: the ledger row is refused before commit.
            assert answer["ok"], answer
            assert kept == rows[EXPECTED[between][2]]
            refusal = ConflictingEntryError if between == "nothing" else RolloutRetiredError
            with pytest.raises(refusal):
                asyncio.run(run.ledger.record(commit_for(second)))
            return
        ok, fragment, kept_name = EXPECTED[between]
        assert answer["ok"] is ok, answer
        assert fragment is None or fragment in answer["error"], answer
        assert kept == rows[kept_name]
        if ok:
            asyncio.run(run.ledger.record(commit_for(second)))
            manifest = asyncio.run(run.ledger.manifest(ROLLOUT))
            assert [record["digest"] for record in manifest["records"]] == [second.call.digest]
    finally:
        run.close()

"""``tokcap inspect`` reads the materializer's side files in a process that never loads the Kafka client.

Only a fresh interpreter shows what a read loads: the test session has the client loaded already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from transports.kafka.materializer.checkpoint import PartitionCheckpoint, checkpoint_path
from transports.kafka.materializer.dead_letters import DeadLetterLog
from transports.kafka.materializer.ownership import write_owner_records

_PROBE = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    from tokcap.cli.inspect import describe_store
    from transports.kafka.cli.side_files import describe_side_files

    described = describe_store(Path(sys.argv[1]), describe_side_files)
    loaded = sorted(name for name in sys.modules if name.split(".")[0] == "confluent_kafka")
    print(json.dumps({"described": described, "loaded": loaded}))
    """
)


def test_inspect_reads_checkpoints_owners_and_dead_letters_without_loading_the_kafka_client(
    tmp_path: Path,
) -> None:
    checkpoint_path(tmp_path, 1).write_bytes(PartitionCheckpoint("tokcap.t", 1, next_offset=9).encode())
    write_owner_records(tmp_path, "tokcap.t", [1, 3])
    DeadLetterLog.of_directory(tmp_path, 1).record(1, 4, "bad", "r1")
    completed = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["loaded"] == []
    assert report["described"]["kafka_checkpoints"] == {
        "kafka-checkpoint-p1.json": {
            "next_offset": 9,
            "partition": 1,
            "pending_chunk_offsets": [],
            "topic": "tokcap.t",
        }
    }
    assert report["described"]["kafka_owners"] == {
        "kafka-owner-p1.json": {"partition": 1, "topic": "tokcap.t"},
        "kafka-owner-p3.json": {"partition": 3, "topic": "tokcap.t"},
    }
    assert report["described"]["dead_letters"] == {
        "kafka-dead-letter-p1.jsonl": [{"offset": 4, "partition": 1, "reason": "bad", "rollout_id": "r1"}]
    }

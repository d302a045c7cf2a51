"""Each block of docs/gym.md's "One block for every process", read from one file by two processes at once.

Each process builds what the block names with Gym 0.7.0's own config path (``token_id_capture_config``,
``build_sink``, ``build_lineage_store``) and the staging sink from the block's own keys, with no setting of its
own (``tests/gym/shared_block_worker.py``). Both serve rollouts at once, each reads the other's through its own
ledger, both leave no private directory behind, and the trainer, built from the same block, delivers every
rollout unmasked. The Kafka blocks name a topic made as ``tokcap topic create`` makes it, whose staged payloads
lie on a topic of their own; the staging block runs once more on an older topic, where stages go inline. Read
back from the broker by their headers, the stages lie as the topic was made for.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from gym_rollouts import tool_use_rollout
from gym_wheel import GymModules, needs_gym_build_sink
from shared_block_worker import built
from staged_layout import keys_staged_apart, stage_messages_inline
from staging_calls import conversation, cumulative_tokens

from tokcap.staging import finalize_rollout
from tokcap.staging.records import staging_key

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("shared_block_worker.py")
SECTION = "## One block for every process"
STAGING_SOURCES = {
    "tokcap.lineage:FileLineageResolver": "tokcap.staging:FileStagingSource",
    "transports.kafka.lineage:KafkaLineageResolver": "transports.kafka.staging:KafkaStagingSource",
}
TOKEN_SOURCES = {
    "tokcap.lineage:FileLineageResolver": "tokcap.store:TokenCaptureStore",
    "transports.kafka.lineage:KafkaLineageResolver": "transports.kafka:KafkaTokenSource",
}


def documented_blocks() -> list[str]:
    """The YAML blocks of the section, in order."""
    text = (REPO / "docs" / "gym.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)


def test_the_section_documents_a_block_per_transport_and_placement() -> None:
    blocks = [yaml.safe_load(text)["token_id_capture"] for text in documented_blocks()]
    assert [(block["lineage_store"], bool(block.get("external_staging"))) for block in blocks] == [
        ("tokcap.lineage:FileLineageResolver", False),
        ("transports.kafka.lineage:KafkaLineageResolver", False),
        ("tokcap.lineage:FileLineageResolver", True),
        ("transports.kafka.lineage:KafkaLineageResolver", True),
    ]
    assert all("store_dir" not in repr(block) for block in blocks)


@dataclass(frozen=True)
class SharedBlock:
    """A documented block written to a file, and how the Kafka topic it names was made (``None``: no topic)."""

    path: Path
    topic: str | None
    payloads: str | None
    """``"apart"``: made as ``tokcap topic create`` makes it; ``"inline"``: an older topic, stages inline."""


BLOCKS = {
    "file": (1, None),
    "kafka": (2, "apart"),
    "file-staging": (3, None),
    "kafka-staging": (4, "apart"),
    "kafka-staging-on-an-older-topic": (4, "inline"),
}


@pytest.fixture(params=list(BLOCKS.values()), ids=list(BLOCKS))
def shared_block(request: pytest.FixtureRequest, tmp_path: Path) -> SharedBlock:
    """The documented block, pointed at this test's directory or broker topic."""
    number, payloads = request.param
    text = documented_blocks()[number - 1]
    text = text.replace("/var/lib/tokcap/run-1", str(tmp_path / "store"))
    topic = None
    if "kafka-1:9092" in text:
        factory = request.getfixturevalue("kafka_topic_factory")
        topic = factory.staged_apart() if payloads == "apart" else factory()
        text = text.replace("kafka-1:9092", factory.bootstrap)
        text = text.replace("run_id: run-1", f"topic: {topic}")
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return SharedBlock(path, topic, payloads)


def _serve_from_two_processes(config_file: Path, out: Path) -> dict[str, Any]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(WORKER.parent)])}
    processes = {
        who: subprocess.Popen(
            [sys.executable, str(WORKER), str(config_file), who, peer, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for who, peer in (("a", "b"), ("b", "a"))
    }
    for who, process in processes.items():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"process {who} failed:\n{output}"
    return {who: orjson.loads((out / f"{who}.json").read_bytes()) for who in processes}


def _assert_stages_went(payloads: str | None, bootstrap: str, topic: str) -> None:
    """Each process's three stages lie as the topic was made for: apart as references, or inline."""
    staged = {staging_key(f"{who}-staged", f"call-{number}") for who in ("a", "b") for number in range(3)}
    if payloads == "apart":
        assert keys_staged_apart(bootstrap, topic) == staged
    else:
        assert stage_messages_inline(bootstrap, topic) >= len(staged)


async def _closed(instance: Any) -> None:
    close = getattr(instance, "close", None)
    result = close() if callable(close) else None
    if asyncio.iscoroutine(result):
        await result


@needs_gym_build_sink
def test_one_documented_block_serves_two_processes_at_once_and_the_trainer_delivers_both(
    gym: GymModules, shared_block: SharedBlock, tmp_path: Path
) -> None:
    config_file = shared_block.path
    seen = _serve_from_two_processes(config_file, tmp_path / "out")
    private = Path(os.environ["TOKCAP_PRIVATE_DIR"])
    assert not private.exists() or list(private.iterdir()) == []
    block = yaml.safe_load(config_file.read_text())["token_id_capture"]
    kwargs = block["lineage_store_kwargs"]
    if block.get("external_staging"):
        assert seen == {
            who: {"resolved": ["call-0", "call-1"], "peer_calls": ["call-0", "call-1", "call-2"]}
            for who in ("a", "b")
        }
        if shared_block.topic is not None:
            _assert_stages_went(shared_block.payloads, kwargs["bootstrap_servers"], shared_block.topic)
        ledger = built(block["lineage_store"], kwargs)
        source = built(STAGING_SOURCES[block["lineage_store"]], kwargs)
        try:
            for who in ("a", "b"):
                last = conversation(f"{who}-staged", 3, extras=True)[-1]
                done = finalize_rollout(asyncio.run(ledger.manifest(f"{who}-staged")), source)
                assert done.row is not None, done.masked_reason
                assert done.row.token_ids == cumulative_tokens(last.call)
        finally:
            asyncio.run(_closed(source))
            asyncio.run(_closed(ledger))
    else:
        source = built(TOKEN_SOURCES[block["lineage_store"]], kwargs)
        try:
            for who in ("a", "b"):
                rollout = tool_use_rollout(f"{who}-put", retry_last=False)
                result = rollout.result()
                asyncio.run(gym.delivery.finalize_rollout_token_capture(result, source))
                assert "mask_sample" not in result, result.get("_ng_token_capture")
                assert result["response"]["output"][-1]["generation_token_ids"] == [106, 107, 108]
        finally:
            asyncio.run(_closed(source))
    assert not private.exists() or list(private.iterdir()) == []

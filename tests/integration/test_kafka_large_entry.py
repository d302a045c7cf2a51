"""A 1,000,000-token entry round-trips with the broker's and topic's default size limits."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tokcap.log.records import TokenEntry
from transports.kafka import KafkaTokenSink, KafkaTokenSource

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_a_million_token_prompt_materializes_as_the_exact_canonical_line(
    kafka_bootstrap: str, kafka_topic: str, tmp_path: Path
) -> None:
    rng = random.Random(5)
    entry = TokenEntry(
        rollout_id="r-huge",
        model_call_id="c-huge",
        prompt_token_ids=[rng.randrange(0, 250_000) for _ in range(1_000_000)],
        generation_token_ids=[rng.randrange(0, 2**40) for _ in range(1000)],
        generation_log_probs=[-rng.random() * 30 for _ in range(1000)],
        created_at=1_700_000_000.123456789,
    )

    async def scenario() -> None:
        sink = KafkaTokenSink(bootstrap_servers=kafka_bootstrap, topic=kafka_topic)
        source = KafkaTokenSource(bootstrap_servers=kafka_bootstrap, topic=kafka_topic, store_dir=tmp_path)
        try:
            await sink.put(entry)
            snapshot = await source.freeze("r-huge")
            assert len(snapshot.entries) == 1
            assert snapshot.entries[0].prompt_token_ids == entry.prompt_token_ids
        finally:
            await sink.close()
            await source.close()

    asyncio.run(scenario())
    assert (tmp_path / "r-huge.tokens.jsonl").read_bytes() == entry.canonical_json() + b"\n"

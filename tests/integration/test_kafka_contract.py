"""The shared capture scenarios through the Kafka path: the same snapshots as the file store."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from store_contract import SinkAndSource, StoreContract

from transports.kafka import KafkaTokenSink, KafkaTokenSource

pytestmark = pytest.mark.kafka


class TestKafkaContract(StoreContract):
    @pytest.fixture(autouse=True)
    def _broker(self, kafka_bootstrap: str, kafka_topic_factory: Any, tmp_path: Path) -> None:
        self.bootstrap = kafka_bootstrap
        self.topic = kafka_topic_factory("contract", partitions=2)
        self.store_dir = tmp_path / "store"

    @contextlib.asynccontextmanager
    async def make_sink_and_source(self) -> AsyncIterator[SinkAndSource]:
        sink = KafkaTokenSink(bootstrap_servers=self.bootstrap, topic=self.topic)
        source = KafkaTokenSource(
            bootstrap_servers=self.bootstrap, topic=self.topic, store_dir=self.store_dir
        )
        try:
            yield sink, source
        finally:
            await sink.close()
            await source.close()

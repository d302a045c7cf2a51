"""The shared capture scenarios against the file store, the reference the Kafka path must match."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from store_contract import SinkAndSource, StoreContract

from tokcap.files.store import TokenCaptureStore


class TestFileStoreContract(StoreContract):
    @pytest.fixture(autouse=True)
    def _store_dir(self, tmp_path: Path) -> None:
        self.store_dir = tmp_path / "store"

    @contextlib.asynccontextmanager
    async def make_sink_and_source(self) -> AsyncIterator[SinkAndSource]:
        store = TokenCaptureStore(self.store_dir)
        try:
            yield store, store
        finally:
            await store.close()

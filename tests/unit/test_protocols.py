"""The sink and source protocols, the process-wide installed endpoints, and the snapshot type."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import make_entry

from tokcap.files.store import TokenCaptureStore
from tokcap.log.records import TokenEntry
from tokcap.protocols import (
    IntentTokenSink,
    RetiringTokenSource,
    RolloutRemovalPayload,
    TokenCaptureSnapshot,
    TokenSink,
    TokenSource,
    install_token_sink,
    install_token_source,
    installed_token_sink,
    installed_token_source,
)


@pytest.fixture(autouse=True)
def _restore_installed_endpoints() -> Iterator[None]:
    """Installed endpoints are process-wide; every test leaves them as it found them."""
    sink, source = installed_token_sink(), installed_token_source()
    yield
    install_token_sink(sink)
    install_token_source(source)


class _SinkWithoutMarkIncomplete:
    async def put(self, entry: TokenEntry) -> None:
        del entry

    async def close(self) -> None:
        return None


class _SourceWithoutDrop:
    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        return TokenCaptureSnapshot(rollout_id, (), False, "s", 1)

    async def close(self) -> None:
        return None


def test_the_file_store_satisfies_both_the_sink_and_the_source_protocol(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    assert isinstance(store, TokenSink)
    assert isinstance(store, TokenSource)


def test_the_file_store_satisfies_the_intent_and_retiring_extensions(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    assert isinstance(store, IntentTokenSink)
    assert isinstance(store, RetiringTokenSource)


def test_the_kafka_sink_tracks_intents_and_the_kafka_source_retires(tmp_path: Path) -> None:
    """Neither constructor contacts the broker (the source waits on an external materializer here)."""
    kafka = pytest.importorskip("transports.kafka")
    unreachable = "127.0.0.1:9"
    sink = kafka.KafkaTokenSink(bootstrap_servers=unreachable, topic="tokcap-protocol-check")
    source = kafka.KafkaTokenSource(
        bootstrap_servers=unreachable,
        topic="tokcap-protocol-check",
        store_dir=tmp_path,
        external_materializer=True,
    )
    try:
        assert isinstance(sink, IntentTokenSink)
        assert isinstance(source, RetiringTokenSource)
    finally:
        asyncio.run(sink.close())
        asyncio.run(source.close())


def test_a_plain_sink_or_source_is_not_mistaken_for_an_extension(tmp_path: Path) -> None:
    class PlainSink:
        async def put(self, entry: TokenEntry) -> None:
            del entry

        async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
            del rollout_id, model_call_id

        async def close(self) -> None:
            return None

    class PlainSource(_SourceWithoutDrop):
        async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
            return True

    assert isinstance(PlainSink(), TokenSink) and not isinstance(PlainSink(), IntentTokenSink)
    assert isinstance(PlainSource(), TokenSource) and not isinstance(PlainSource(), RetiringTokenSource)


def test_a_sink_without_mark_incomplete_does_not_satisfy_the_sink_protocol() -> None:
    assert not isinstance(_SinkWithoutMarkIncomplete(), TokenSink)


def test_a_source_without_drop_does_not_satisfy_the_source_protocol() -> None:
    assert not isinstance(_SourceWithoutDrop(), TokenSource)


def test_the_file_store_used_only_through_the_protocols_captures_freezes_and_drops(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    sink: TokenSink = store
    source: TokenSource = store

    async def scenario() -> tuple[TokenCaptureSnapshot, bool]:
        await sink.put(make_entry("r1", "c1"))
        await sink.put(make_entry("r1", "c2", generation=[9]))
        snapshot = await source.freeze("r1")
        dropped = await source.drop("r1", snapshot.snapshot_id, snapshot.version)
        await sink.close()
        await source.close()
        return snapshot, dropped

    snapshot, dropped = asyncio.run(scenario())
    assert sorted(entry.model_call_id for entry in snapshot.entries) == ["c1", "c2"]
    assert snapshot.incomplete is False
    assert dropped is True


def test_mark_incomplete_through_the_sink_protocol_shows_in_the_snapshot(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)

    async def scenario() -> TokenCaptureSnapshot:
        await store.put(make_entry("r2", "c1"))
        await store.mark_incomplete("r2", "c2")
        return await store.freeze("r2")

    snapshot = asyncio.run(scenario())
    assert snapshot.incomplete is True
    assert [entry.model_call_id for entry in snapshot.entries] == ["c1"]


def test_installing_a_sink_makes_it_the_installed_one_and_none_clears_it(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    install_token_sink(store)
    assert installed_token_sink() is store
    install_token_sink(None)
    assert installed_token_sink() is None


def test_installing_a_source_makes_it_the_installed_one_and_none_clears_it(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    install_token_source(store)
    assert installed_token_source() is store
    install_token_source(None)
    assert installed_token_source() is None


def test_installing_a_sink_leaves_the_installed_source_alone(tmp_path: Path) -> None:
    sink_store = TokenCaptureStore(tmp_path / "sink")
    source_store = TokenCaptureStore(tmp_path / "source")
    install_token_source(source_store)
    install_token_sink(sink_store)
    assert installed_token_source() is source_store
    assert installed_token_sink() is sink_store


def test_a_snapshot_cannot_be_modified_after_it_is_taken() -> None:
    snapshot = TokenCaptureSnapshot("r1", (make_entry(),), False, "snap-1", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.version = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.incomplete = True  # type: ignore[misc]
    assert isinstance(snapshot.entries, tuple)


def test_a_snapshot_from_the_file_store_holds_its_entries_in_a_tuple(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r3", "c1"))
    snapshot = store.freeze_now("r3")
    assert isinstance(snapshot.entries, tuple)
    assert snapshot.rollout_id == "r3"
    assert snapshot.snapshot_id
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.entries = ()  # type: ignore[misc]


def test_a_removal_payload_reports_removed_and_not_found_ids_as_lists() -> None:
    payload = RolloutRemovalPayload(removed=("a", "b"), not_found=("c",))
    assert payload.to_dict() == {"removed": ["a", "b"], "not_found": ["c"]}
    assert RolloutRemovalPayload().to_dict() == {"removed": [], "not_found": []}

"""tokcap's capture path resolves each call's parent before dispatch and stamps it on the stored entry."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from factories import chat_response

from tokcap import sink
from tokcap.files.store import TokenCaptureStore
from tokcap.lineage import FileLineageResolver, LineageResolution
from tokcap.log.records import ParentResolutionStatus, TokenEntry, compute_digest
from tokcap.protocols import install_lineage_store

FIRST = [{"role": "user", "content": "hi"}]


async def _call(
    store: TokenCaptureStore,
    call_id: str,
    request: list[dict[str, Any]],
    response: dict[str, Any],
    lineage: Any,
) -> None:
    context = sink.CaptureContext("r", call_id, store, lineage_store=lineage)
    token = sink.set_token_sink(context)
    try:
        await sink.resolve_parent(request)
        await sink.capture_tokens(response)
    finally:
        sink.reset_token_sink(token)


def _second_request() -> list[dict[str, Any]]:
    return [*FIRST, {"role": "assistant", "content": "one"}, {"role": "user", "content": "more"}]


@pytest.fixture
def installed(tmp_path: Path) -> Any:
    resolver = FileLineageResolver(tmp_path)
    install_lineage_store(resolver)
    yield resolver
    install_lineage_store(None)


def test_the_installed_resolver_links_a_continuation_when_the_context_names_none(
    tmp_path: Path, installed: Any
) -> None:
    store = TokenCaptureStore(tmp_path)

    async def run() -> None:
        await _call(store, "c1", FIRST, chat_response("one", [1, 2], [3]), None)
        await _call(store, "c2", _second_request(), chat_response("two", [1, 2, 3, 4], [5]), None)

    asyncio.run(run())
    entries = {entry.model_call_id: entry for entry in store.read_entries("r")}
    assert (entries["c1"].parent_resolution, entries["c1"].parent_call_id) == ("root", None)
    assert (entries["c2"].parent_resolution, entries["c2"].parent_call_id) == ("resolved", "c1")
    assert entries["c2"].digest == compute_digest([1, 2, 3, 4, 5])
    assert entries["c2"].cum_len == 5
    assert entries["c2"].response_id == "resp-two"


class _BrokenResolver:
    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> LineageResolution:
        raise OSError("disk gone")

    def is_process_shared(self) -> bool:
        return True

    async def close(self) -> None:
        return None


def test_a_failing_resolver_leaves_the_call_unresolved_with_reason_lookup_error_and_still_stores_it(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    asyncio.run(_call(store, "c2", _second_request(), chat_response("two", [1], [5]), _BrokenResolver()))
    (entry,) = store.read_entries("r")
    assert (entry.parent_resolution, entry.parent_resolution_reason) == ("unresolved", "lookup_error")


def test_an_engine_side_commit_without_a_decision_is_stamped_unresolved_not_attempted(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    entry = TokenEntry(
        rollout_id="r",
        model_call_id="c1",
        prompt_token_ids=[1],
        generation_token_ids=[2],
        generation_log_probs=[0.0],
    )

    async def run() -> bool:
        token = sink.set_token_sink(sink.CaptureContext("r", "c1", store))
        try:
            return await sink.commit_entry(entry)
        finally:
            sink.reset_token_sink(token)

    assert asyncio.run(run()) is True
    (stored,) = store.read_entries("r")
    assert stored.parent_resolution == ParentResolutionStatus.UNRESOLVED
    assert stored.parent_resolution_reason == "not_attempted"
    assert stored.digest == compute_digest([1, 2])

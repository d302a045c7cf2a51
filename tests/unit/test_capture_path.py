"""The request-scoped capture path: contexts, intents, capture and the failure chain of DESIGN.md."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import BaseModel

from tests.factories import (
    assistant_message_item,
    chat_completions_payload,
    make_entry,
    responses_payload,
    token_fields,
)
from tests.unit.capture_fakes import FlakySink, InjectedSinkFailure, PutOnlySink
from tokcap.files.store import TokenCaptureStore
from tokcap.protocols import install_token_sink
from tokcap.sink import (
    CaptureContext,
    cancel_call_intent,
    capture_tokens,
    commit_entry,
    current_capture_context,
    register_call_intent,
    reset_token_sink,
    set_token_sink,
)

T = TypeVar("T")


def run(awaitable: Awaitable[T]) -> T:
    async def wrapper() -> T:
        return await awaitable

    return asyncio.run(wrapper())


@pytest.fixture(autouse=True)
def _no_installed_sink() -> Iterator[None]:
    install_token_sink(None)
    yield
    install_token_sink(None)


def in_context(context: CaptureContext, awaitable: Awaitable[T]) -> T:
    """Run one step of a model call inside its capture context, as the middleware would."""

    async def call() -> T:
        token = set_token_sink(context)
        try:
            return await awaitable
        finally:
            reset_token_sink(token)

    return asyncio.run(call())


def tool_call_item() -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_1", "call_id": "tc_1", "name": "search", "arguments": "{}"}


def tokened_response() -> dict[str, Any]:
    return responses_payload(
        tool_call_item(), {**assistant_message_item("hi"), **token_fields([1, 2], [7, 8])}
    )


def test_a_context_is_visible_only_between_set_and_reset() -> None:
    context = CaptureContext("r", "c1", None)
    assert current_capture_context() is None
    token = set_token_sink(context)
    assert current_capture_context() is context
    reset_token_sink(token)
    assert current_capture_context() is None


def test_capture_stores_the_arrays_and_keeps_the_content_without_them(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    context = CaptureContext("r", "c1", store, model="policy")
    stored = in_context(context, capture_tokens(tokened_response()))
    assert stored is not None
    [entry] = store.read_entries("r")
    assert entry.prompt_token_ids == [1, 2]
    assert entry.generation_token_ids == [7, 8]
    assert entry.model == "policy"
    assert entry.token_item_index == 1
    assert entry.output_items[0] == tool_call_item()
    assert "generation_token_ids" not in entry.output_items[1]
    assert entry.output_items[1]["content"][0]["text"] == "hi"
    assert context.committed


def test_capture_reads_chat_completions_messages(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    message = {"role": "assistant", "content": "hello", **token_fields([3], [4, 5])}
    in_context(CaptureContext("r", "c1", store), capture_tokens(chat_completions_payload(message)))
    [entry] = store.read_entries("r")
    assert entry.generation_token_ids == [4, 5]
    assert entry.output_items == [{"role": "assistant", "content": "hello"}]
    assert entry.token_item_index == 0
    assert entry.model == "test-model"


class _ResponseModel(BaseModel):
    model: str
    output: list[dict[str, Any]]


def test_capture_accepts_a_pydantic_response(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    response = _ResponseModel(model="m", output=[{**assistant_message_item(), **token_fields([1], [2])}])
    in_context(CaptureContext("r", "c1", store), capture_tokens(response))
    assert [e.model_call_id for e in store.read_entries("r")] == ["c1"]


def test_a_second_capture_of_a_committed_call_does_not_write_again(tmp_path: Path) -> None:
    sink = FlakySink(TokenCaptureStore(tmp_path))
    context = CaptureContext("r", "c1", sink)
    in_context(context, capture_tokens(tokened_response()))
    in_context(context, capture_tokens({"output": []}))
    assert sink.puts == ["c1"]
    assert sink.marks == []


def test_capture_without_a_context_does_nothing(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    install_token_sink(store)
    assert run(capture_tokens(tokened_response())) is None
    assert store.rollout_ids() == []


def test_capture_without_any_sink_does_nothing() -> None:
    context = CaptureContext("r", "c1", None)
    assert in_context(context, capture_tokens({"output": []})) is None
    assert not context.committed


def test_the_installed_sink_serves_a_context_without_its_own(tmp_path: Path) -> None:
    installed = TokenCaptureStore(tmp_path / "installed")
    install_token_sink(installed)
    in_context(CaptureContext("r", "c1", None), capture_tokens(tokened_response()))
    assert [e.model_call_id for e in installed.read_entries("r")] == ["c1"]


def test_the_context_sink_wins_over_the_installed_sink(tmp_path: Path) -> None:
    installed = TokenCaptureStore(tmp_path / "installed")
    own = TokenCaptureStore(tmp_path / "own")
    install_token_sink(installed)
    in_context(CaptureContext("r", "c1", own), capture_tokens(tokened_response()))
    assert [e.model_call_id for e in own.read_entries("r")] == ["c1"]
    assert installed.rollout_ids() == []


@pytest.mark.parametrize(
    "response",
    [
        pytest.param(responses_payload(assistant_message_item()), id="no-token-ids"),
        pytest.param(["not", "a", "response"], id="unsupported-type"),
        pytest.param(
            responses_payload({**assistant_message_item(), "generation_token_ids": [1]}), id="partial-arrays"
        ),
        pytest.param(
            responses_payload(
                {**assistant_message_item(), **token_fields([1], [2]), "generation_log_probs": []}
            ),
            id="arrays-disagree",
        ),
    ],
)
def test_a_response_that_cannot_be_captured_marks_the_rollout_incomplete(
    tmp_path: Path, response: Any
) -> None:
    store = TokenCaptureStore(tmp_path)
    context = CaptureContext("r", "c1", store)
    assert in_context(context, capture_tokens(response)) is None
    assert store.is_incomplete("r")
    assert not context.committed


def test_a_failed_put_marks_the_rollout_incomplete_without_failing_the_call(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    sink = FlakySink(store, fail_put=True)
    assert in_context(CaptureContext("r", "c1", sink), capture_tokens(tokened_response())) is None
    assert sink.marks == [("r", "c1")]
    assert store.freeze_now("r").incomplete


def test_when_put_and_marking_both_fail_the_dangling_intent_masks_the_rollout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = TokenCaptureStore(tmp_path)
    sink = FlakySink(store, fail_put=True, fail_mark=True)
    context = CaptureContext("rollout-x", "c1", sink)
    in_context(context, register_call_intent())
    with caplog.at_level(logging.ERROR, logger="tokcap.sink"):
        assert in_context(context, capture_tokens(tokened_response())) is None
    assert not store.is_incomplete("rollout-x")
    assert any("rollout-x" in record.getMessage() and record.exc_info for record in caplog.records)
    snapshot = store.freeze_now("rollout-x")
    assert snapshot.entries == ()
    assert snapshot.incomplete


def test_a_sink_without_mark_incomplete_logs_an_error_naming_the_rollout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = PutOnlySink()
    with caplog.at_level(logging.ERROR, logger="tokcap.sink"):
        assert in_context(CaptureContext("rollout-y", "c1", sink), capture_tokens(tokened_response())) is None
    assert sink.puts == ["c1"]
    assert any(
        "no mark_incomplete" in r.getMessage() and "rollout-y" in r.getMessage() for r in caplog.records
    )


def test_an_intent_failure_propagates_before_generation(tmp_path: Path) -> None:
    sink = FlakySink(TokenCaptureStore(tmp_path), fail_begin=True)
    with pytest.raises(InjectedSinkFailure):
        in_context(CaptureContext("r", "c1", sink), register_call_intent())


def test_an_intent_without_its_entry_masks_the_rollout_at_freeze(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    in_context(CaptureContext("r", "c1", store), register_call_intent())
    assert store.freeze_now("r").incomplete


def test_an_intent_followed_by_its_entry_leaves_the_rollout_complete(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    context = CaptureContext("r", "c1", store)
    in_context(context, register_call_intent())
    in_context(context, capture_tokens(tokened_response()))
    snapshot = store.freeze_now("r")
    assert not snapshot.incomplete
    assert [e.model_call_id for e in snapshot.entries] == ["c1"]


def test_a_cancelled_intent_does_not_mask_the_rollout(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    context = CaptureContext("r", "c1", store)
    in_context(context, register_call_intent())
    in_context(context, cancel_call_intent())
    assert not store.freeze_now("r").incomplete


def test_registering_an_intent_is_a_no_op_without_context_or_begin_call() -> None:
    run(register_call_intent())
    sink = PutOnlySink()
    in_context(CaptureContext("r", "c1", sink), register_call_intent())
    assert sink.puts == []


def test_commit_entry_stores_an_engine_side_entry(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    context = CaptureContext("r", "c1", store)
    assert in_context(context, commit_entry(make_entry("r", "c1")))
    assert context.committed
    assert [e.model_call_id for e in store.read_entries("r")] == ["c1"]


@pytest.mark.parametrize(("rollout_id", "call_id"), [("other", "c1"), ("r", "c2")])
def test_commit_entry_with_a_foreign_identity_marks_the_context_rollout_incomplete(
    tmp_path: Path, rollout_id: str, call_id: str
) -> None:
    store = TokenCaptureStore(tmp_path)
    assert not in_context(CaptureContext("r", "c1", store), commit_entry(make_entry(rollout_id, call_id)))
    assert store.is_incomplete("r")
    assert store.read_entries("r") == []
    assert store.rollout_ids() == ["r"]


def test_commit_entry_with_a_failed_put_marks_the_rollout_incomplete(tmp_path: Path) -> None:
    store = TokenCaptureStore(tmp_path)
    sink = FlakySink(store, fail_put=True)
    assert not in_context(CaptureContext("r", "c1", sink), commit_entry(make_entry("r", "c1")))
    assert store.is_incomplete("r")

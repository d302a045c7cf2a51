"""Events read back from a log pass the sinks' input rules, and no side-file line can hold a call id that breaks it."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from tokcap.errors import InvalidInputError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import (
    CancelEvent,
    DropEvent,
    Event,
    FreezeEvent,
    IncompleteEvent,
    IntentEvent,
    PutEvent,
    encode_event,
)
from tokcap.log.input_rules import accept_event, check_entry_fields, check_event
from tokcap.log.records import TokenEntry
from tokcap.log.rules import cancel_line, intent_line, mark_line

BAD_CALL_IDS = ["a\nb", "c9\r\x00c1", "z" * 5000]


def entry(**fields: Any) -> TokenEntry:
    values: dict[str, Any] = {
        "rollout_id": "r1",
        "model_call_id": "c1",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [7, 8],
        "generation_log_probs": [-0.5, -0.25],
    }
    return TokenEntry(**{**values, **fields})


@pytest.mark.parametrize("call_id", BAD_CALL_IDS)
@pytest.mark.parametrize("kind", [IntentEvent, CancelEvent, IncompleteEvent])
def test_an_event_carrying_a_call_id_the_sinks_refuse_is_refused_naming_the_field(
    kind: Any, call_id: str
) -> None:
    with pytest.raises(InvalidInputError, match="model_call_id") as refused:
        check_event(kind(rollout_id="r1", model_call_id=call_id))
    assert refused.value.rollout_id == "r1"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt_token_ids": [5, -7, 9]}, "prompt_token_ids"),
        ({"generation_token_ids": [2**64, 1]}, "generation_token_ids"),
        ({"model_call_id": "a\nb"}, "model_call_id"),
        ({"output_items": [{"score": float("inf")}]}, "output_items"),
        ({"created_at": float("nan")}, "created_at"),
    ],
)
def test_a_put_whose_entry_the_sinks_refuse_is_refused_naming_the_field(
    fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidInputError, match=field):
        check_event(PutEvent(rollout_id="r1", entry=entry(**fields)))


def test_events_a_sink_sends_pass_unchanged() -> None:
    events: list[Event] = [
        IntentEvent(rollout_id="r1", model_call_id="c1"),
        CancelEvent(rollout_id="r1", model_call_id="c1"),
        IncompleteEvent(rollout_id="r1", reason="lost\nline", marker_id="s-1"),
        PutEvent(rollout_id="r1", entry=entry(prompt_token_ids=[0, 2**64 - 1])),
        FreezeEvent(rollout_id="r1"),
        DropEvent(rollout_id="r1", snapshot_id="t:0:1", version=2),
    ]
    for event in events:
        assert check_event(event) is event
        assert accept_event(orjson.loads(encode_event(event))) == event


@pytest.mark.parametrize("values", [[True], [False, 1], [1.0, 2]], ids=["true", "false", "float"])
def test_a_token_id_decoded_from_json_as_anything_but_an_int_is_refused(values: list[object]) -> None:
    raw = orjson.loads(encode_event(PutEvent(rollout_id="r1", entry=entry())))
    raw["entry"]["generation_token_ids"] = values
    raw["entry"]["generation_log_probs"] = [-0.5] * len(values)
    with pytest.raises(InvalidInputError, match="generation_token_ids must hold ints only"):
        accept_event(raw)


def test_the_fields_of_an_entry_kept_without_its_arrays_are_checked_by_the_same_rules() -> None:
    head = {k: v for k, v in entry().model_dump(mode="json").items() if not k.endswith(("_ids", "_probs"))}
    check_entry_fields(head)
    for bad, field in (
        ({"model_call_id": "a\nb"}, "model_call_id"),
        ({"model_call_id": 7}, "model_call_id"),
        ({"created_at": "1.5"}, "created_at"),
        ({"output_items": [{"x": float("inf")}]}, "output_items"),
    ):
        with pytest.raises(InvalidInputError, match=field):
            check_entry_fields({**head, **bad})


@pytest.mark.parametrize("call_id", BAD_CALL_IDS)
def test_no_side_file_line_writer_accepts_a_call_id_that_would_not_stay_one_line(call_id: str) -> None:
    for writer in (intent_line, cancel_line, mark_line):
        with pytest.raises(InvalidInputError, match="model_call_id"):
            writer(call_id)
    assert (intent_line("c1"), cancel_line("c1"), mark_line("")) == (b"c1\n", b"\x00c1\n", b"\n")


@pytest.mark.parametrize("bad", [5.0, None, "5", True, False])
def test_a_token_id_that_is_no_int_appended_after_the_entry_was_built_is_refused_and_nothing_is_stored(
    tmp_path: Any, bad: object
) -> None:
    built = entry()
    built.prompt_token_ids.append(bad)  # type: ignore[arg-type]
    store = TokenCaptureStore(str(tmp_path))
    with pytest.raises(InvalidInputError, match=r"prompt_token_ids holds .*where an int belongs"):
        asyncio.run(store.put(built))
    assert not list(tmp_path.glob("*.tokens.jsonl"))

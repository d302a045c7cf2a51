"""A copy of an entry is exactly what a fresh read of its stored line gives, or no copy is made.

Compared exactly: types, float signs, dict key order, extra fields and the fields-set, not just ``==``.
The strategy draws entries the store accepts (Gym-shaped lineage fields, extras, nested output items),
some changed afterwards into values a parse would give back differently.
"""

from __future__ import annotations

import enum
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.exact_shape import exact_shape
from tokcap.files.entry_copies import fresh_read_copy
from tokcap.log.records import ParentResolutionStatus, TokenEntry, compute_digest

_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_json = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_token_ids = st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=6)
_extra_names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6).map(lambda name: f"x_{name}")


class _Color(enum.StrEnum):
    RED = "red"


_ARRAYS_NOT_EXACT = [
    lambda entry: entry.prompt_token_ids.append(True),
    lambda entry: entry.generation_log_probs.append(-1),
]
"""Changes only the per-value check of the token arrays finds; a caller passing ``arrays_exact`` rules them out."""

_NOT_EXACT = [
    *_ARRAYS_NOT_EXACT,
    lambda entry: setattr(entry, "prompt_token_ids", (1, 2)),
    lambda entry: entry.output_items.append({"tuple": (1, 2)}),
    lambda entry: entry.output_items.append({1: "int key"}),
    lambda entry: setattr(entry, "model", _Color.RED),
    lambda entry: setattr(entry, "created_at", 5),
    lambda entry: setattr(entry, "parent_resolution_reason", None),
    lambda entry: setattr(entry, "routed_experts", [[1, 2]]),
    lambda entry: (entry.__pydantic_extra__ or {}).update(x_enum=_Color.RED),
]


@st.composite
def _entries(draw: st.DrawFn, arrays_changed: bool = True) -> tuple[TokenEntry, bool]:
    """An entry the store accepts, Gym-shaped fields included; maybe changed afterwards into one not exact.

    With ``arrays_changed`` false, no change puts a value of another type into a token array.
    """
    prompt = draw(_token_ids)
    generation = draw(_token_ids)
    log_probs = draw(
        st.lists(
            st.floats(allow_nan=False, allow_infinity=False, width=draw(st.sampled_from([32, 64]))),
            min_size=len(generation),
            max_size=len(generation),
        )
    )
    items = draw(st.lists(st.dictionaries(st.text(max_size=6), _json, max_size=4), max_size=3))
    lineage = draw(st.sampled_from(["none", "root", "unresolved", "resolved", "delta"]))
    fields: dict[str, Any] = {}
    if lineage != "none":
        fields["parent_resolution"] = ParentResolutionStatus("resolved" if lineage == "delta" else lineage)
        fields["cum_len"] = len(prompt) + len(generation)
        fields["digest"] = compute_digest([*prompt, *generation])
        fields["parent_resolution_reason"] = draw(st.text(max_size=8))
        fields["continuation_fingerprint"] = draw(st.text(max_size=8))
        fields["continuation_context_len"] = draw(st.integers(min_value=0, max_value=10**6))
        fields["fingerprint_version"] = draw(st.none() | st.integers(min_value=0, max_value=3))
    if lineage in ("resolved", "delta"):
        fields["parent_call_id"] = draw(st.text(min_size=1, max_size=8))
        fields["prompt_is_delta"] = lineage == "delta"
    extras = draw(st.dictionaries(_extra_names, _json, max_size=3))
    entry = TokenEntry(
        rollout_id="r",
        model_call_id=draw(st.text(alphabet="abc-_0123456789", min_size=1, max_size=8)),
        model=draw(st.text(max_size=10)),
        prompt_token_ids=prompt,
        generation_token_ids=generation,
        generation_log_probs=log_probs,
        output_items=items,
        token_item_index=draw(st.none() | st.integers(min_value=0, max_value=len(items) - 1))
        if items
        else None,
        response_id=draw(st.none() | st.text(max_size=8)),
        created_at=draw(st.floats(allow_nan=False, allow_infinity=False)),
        prefix_requested=draw(st.booleans()),
        prefix_supplied=draw(st.booleans()),
        **fields,
        **extras,
    )
    spoiled = draw(st.booleans())
    if spoiled:
        changes = _NOT_EXACT if arrays_changed else _NOT_EXACT[len(_ARRAYS_NOT_EXACT) :]
        draw(st.sampled_from(changes))(entry)
    return entry, not spoiled


@settings(max_examples=400, deadline=None)
@given(_entries())
def test_a_copy_is_exactly_what_a_fresh_read_of_the_line_gives_or_none_is_made(
    drawn: tuple[TokenEntry, bool],
) -> None:
    entry, exact = drawn
    copy = fresh_read_copy(entry)
    if exact:
        assert copy is not None, "an entry of JSON values only must be copied"
    if copy is None:
        return
    line = entry.canonical_json()
    assert copy.canonical_json() == line
    assert exact_shape(copy) == exact_shape(TokenEntry.from_json(line))
    assert TokenEntry.from_json(line) == copy


@settings(max_examples=300, deadline=None)
@given(_entries(arrays_changed=False))
def test_an_entry_whose_arrays_its_caller_vouches_for_is_copied_exactly_without_checking_each_value(
    drawn: tuple[TokenEntry, bool],
) -> None:
    entry, exact = drawn
    copy = fresh_read_copy(entry, arrays_exact=True)
    if exact:
        assert copy is not None, "an entry of JSON values only must be copied"
    if copy is None:
        return
    line = entry.canonical_json()
    assert exact_shape(copy) == exact_shape(TokenEntry.from_json(line))
    for name in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
        assert getattr(copy, name) is not getattr(entry, name), f"{name} must be a copy, not the same list"


def test_a_copy_shares_nothing_a_caller_could_change_with_the_original() -> None:
    entry = TokenEntry(
        rollout_id="r",
        model_call_id="c",
        model="m",
        prompt_token_ids=[1, 2],
        generation_token_ids=[3],
        generation_log_probs=[-0.5],
        output_items=[{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}],
        x_extra={"nested": [1]},
    )
    line = entry.canonical_json()
    copy = fresh_read_copy(entry)
    assert copy is not None
    copy.prompt_token_ids.append(9)
    copy.generation_log_probs[0] = 0.0
    copy.output_items[0]["content"][0]["text"] = "changed"
    (copy.__pydantic_extra__ or {})["x_extra"]["nested"].append(2)
    assert entry.canonical_json() == line

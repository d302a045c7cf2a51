"""The file store against a small in-memory reference model, driven by random event sequences.

After every step the store's observable state (entries, incomplete, lifecycle, snapshot) must equal the model's.
Some puts go through a second store instance on the same directory, as another process would write, and every
snapshot must be exactly what a fresh read of the files gives (the freezing store may answer from kept copies).
"""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.exact_shape import exact_shape
from tokcap.errors import ConflictingEntryError, RolloutFrozenError, RolloutRetiredError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.records import TokenEntry

ROLLOUTS = ["r-a", "r-b"]
CALLS = ["c1", "c2", "c3"]


def entry(rollout_id: str, call_id: str, variant: int) -> TokenEntry:
    return TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        prompt_token_ids=[1, 2, variant],
        generation_token_ids=[7, variant],
        generation_log_probs=[-0.25, -0.5],
        created_at=0.0,
    )


@dataclass
class ModelRollout:
    lifecycle: str = "open"
    entries: dict[str, int] = field(default_factory=dict)
    intents: dict[str, str] = field(default_factory=dict)
    incomplete: bool = False
    version: int = 0
    snapshot_id: str | None = None
    known: bool = False


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="tokcap-stateful-"))
        self.store = TokenCaptureStore(self.directory)
        self.other = TokenCaptureStore(self.directory)
        self.model: dict[str, ModelRollout] = {rid: ModelRollout() for rid in ROLLOUTS}

    def teardown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    # ------------------------------------------------------------ writes

    def _expect_put(self, rollout_id: str, call_id: str, variant: int) -> type[Exception] | None:
        model = self.model[rollout_id]
        if model.lifecycle == "retired":
            return RolloutRetiredError
        known = model.entries.get(call_id)
        if known == variant:
            return None
        if model.lifecycle == "frozen":
            model.version += 1
            return RolloutFrozenError
        model.version += 1
        if known is not None:
            model.incomplete = True
            return ConflictingEntryError
        model.entries[call_id] = variant
        model.known = True
        return None

    @rule(
        rollout_id=st.sampled_from(ROLLOUTS),
        call_id=st.sampled_from(CALLS),
        variant=st.integers(0, 1),
        elsewhere=st.booleans(),
    )
    def put(self, rollout_id: str, call_id: str, variant: int, elsewhere: bool) -> None:
        expected = self._expect_put(rollout_id, call_id, variant)
        writer = self.other if elsewhere else self.store
        if expected is None:
            writer.append(entry(rollout_id, call_id, variant))
        else:
            with pytest.raises(expected):
                writer.append(entry(rollout_id, call_id, variant))

    @rule(rollout_id=st.sampled_from(ROLLOUTS), variant=st.integers(0, 1), workers=st.integers(2, 4))
    def concurrent_repeated_puts_of_new_calls(self, rollout_id: str, variant: int, workers: int) -> None:
        model = self.model[rollout_id]
        fresh = [call for call in ["p1", "p2", "p3", "p4"] if call not in model.entries]
        if model.lifecycle != "open" or not fresh:
            return
        batch = [entry(rollout_id, call, variant) for call in fresh] * 2
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(self.store.append, batch))
        for call in fresh:
            model.entries[call] = variant
        model.version += len(fresh)
        model.known = True

    @rule(rollout_id=st.sampled_from(ROLLOUTS), call_id=st.sampled_from(CALLS), cancel=st.booleans())
    def intent_or_cancel(self, rollout_id: str, call_id: str, cancel: bool) -> None:
        model = self.model[rollout_id]
        op = "cancel" if cancel else "intent"
        call = self.store.cancel_call_now if cancel else self.store.begin_call_now
        if model.lifecycle == "retired":
            with pytest.raises(RolloutRetiredError):
                call(rollout_id, call_id)
            return
        if model.intents.get(call_id) == op:
            call(rollout_id, call_id)
            return
        if model.lifecycle == "frozen":
            model.version += 1
            with pytest.raises(RolloutFrozenError):
                call(rollout_id, call_id)
            return
        call(rollout_id, call_id)
        model.intents[call_id] = op
        model.known = True

    @rule(rollout_id=st.sampled_from(ROLLOUTS), call_id=st.sampled_from(CALLS))
    def mark_incomplete(self, rollout_id: str, call_id: str) -> None:
        model = self.model[rollout_id]
        if model.lifecycle == "retired":
            with pytest.raises(RolloutRetiredError):
                self.store.mark_incomplete_now(rollout_id, call_id)
            return
        self.store.mark_incomplete_now(rollout_id, call_id)
        model.incomplete = True
        model.known = True
        model.version += 1

    # ----------------------------------------------------------- lifecycle

    @rule(rollout_id=st.sampled_from(ROLLOUTS))
    def freeze(self, rollout_id: str) -> None:
        model = self.model[rollout_id]
        if model.lifecycle == "retired":
            with pytest.raises(RolloutRetiredError):
                self.store.freeze_now(rollout_id)
            return
        if model.lifecycle == "open":
            dangling = [c for c, op in model.intents.items() if op == "intent" and c not in model.entries]
            model.incomplete = model.incomplete or bool(dangling)
            model.lifecycle = "frozen"
            model.version += 1
            model.known = True
        snapshot = self.store.freeze_now(rollout_id)
        if model.snapshot_id is None:
            model.snapshot_id = snapshot.snapshot_id
        assert snapshot.snapshot_id == model.snapshot_id
        assert snapshot.version == model.version
        assert snapshot.incomplete == model.incomplete
        assert {e.model_call_id: e.prompt_token_ids[2] for e in snapshot.entries} == model.entries
        fresh = TokenCaptureStore(self.directory, kept_entry_tokens=0).read_entries(rollout_id)
        assert [exact_shape(e) for e in snapshot.entries] == [exact_shape(e) for e in fresh]

    @rule(rollout_id=st.sampled_from(ROLLOUTS), stale=st.booleans())
    def drop(self, rollout_id: str, stale: bool) -> None:
        model = self.model[rollout_id]
        snapshot_id = model.snapshot_id or "never-frozen"
        version = model.version - 1 if stale else model.version
        matches = model.lifecycle in ("frozen", "retired") and model.snapshot_id is not None and not stale
        assert self.store.drop_now(rollout_id, snapshot_id, version) is matches
        if matches:
            model.lifecycle = "retired"

    @rule(rollout_ids=st.lists(st.sampled_from(ROLLOUTS), min_size=1, max_size=3))
    def retire(self, rollout_ids: list[str]) -> None:
        unique = list(dict.fromkeys(rollout_ids))
        expected_removed = tuple(
            r for r in unique if self.model[r].known and self.model[r].lifecycle != "retired"
        )
        payload = self.store.retire_now(rollout_ids)
        assert payload.removed == expected_removed
        assert set(payload.removed) | set(payload.not_found) == set(unique)
        for rollout_id in unique:
            self.model[rollout_id].lifecycle = "retired"

    @rule(rollout_ids=st.lists(st.sampled_from(ROLLOUTS), min_size=1, max_size=3))
    def delete(self, rollout_ids: list[str]) -> None:
        unique = list(dict.fromkeys(rollout_ids))
        expected_removed = tuple(
            r for r in unique if self.model[r].known or self.model[r].lifecycle == "retired"
        )
        payload = self.store.delete_now(rollout_ids)
        assert payload.removed == expected_removed
        for rollout_id in unique:
            self.model[rollout_id] = ModelRollout()

    # ----------------------------------------------------------- invariants

    @invariant()
    def store_matches_model(self) -> None:
        for rollout_id, model in self.model.items():
            state = self.store.read_state(rollout_id)
            assert state.lifecycle.value == model.lifecycle
            if model.lifecycle == "retired":
                assert self.store.read_entries(rollout_id) == []
                assert not self.store.path_for(rollout_id).exists()
                continue
            entries = self.store.read_entries(rollout_id)
            assert {e.model_call_id: e.prompt_token_ids[2] for e in entries} == model.entries
            assert len(entries) == len(model.entries)
            assert self.store.is_incomplete(rollout_id) == model.incomplete
            assert state.version == model.version


TestStoreAgainstReferenceModel = StoreMachine.TestCase
TestStoreAgainstReferenceModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

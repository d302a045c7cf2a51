"""The typed state of one rollout, as the store keeps it in ``<rollout_id>.tokens.state.json``.

A rollout moves open → frozen → retired and never back; ``delete`` forgets it.
``removed_records`` tells whether the retire or delete that produced this state removed anything.
``version`` is 0 while open, becomes 1 at freeze, and moves on every later change
(a rejected late write, a late incomplete marker), so a stale snapshot cannot be dropped.

The state is the commit record of the rollout's side files: ``indexed_size``, ``intents_size`` and
``incomplete_size`` say how many bytes of each file it covers, and ``last_position`` which log position
it reflects. Bytes past those sizes were written after the state and are either folded in (file store)
or cut and applied again (a projection resuming from its log), see ``tokcap.recovery``.
"""

from __future__ import annotations

import enum
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from tokcap.errors import NewerSchemaError, StoreCorruptionError
from tokcap.events import LogPosition

__all__ = [
    "STATE_SCHEMA_VERSION",
    "FreezeAnswer",
    "IncompleteMark",
    "IntentOp",
    "Lifecycle",
    "Rejection",
    "RolloutState",
]

STATE_SCHEMA_VERSION = 2
"""The newest state-file schema this reader understands."""


class Lifecycle(enum.StrEnum):
    """Where a rollout is in its life; transitions only go forward."""

    OPEN = "open"
    FROZEN = "frozen"
    RETIRED = "retired"


class Rejection(BaseModel):
    """A write that arrived after the cut: kept as evidence that an attempt was still running."""

    model_config = ConfigDict(extra="forbid")

    event_type: str
    model_call_id: str = ""
    position: dict[str, Any] | None = None


class IntentOp(enum.StrEnum):
    """The last thing recorded about a dispatched call before its entry."""

    INTENT = "intent"
    CANCEL = "cancel"


class IncompleteMark(BaseModel):
    """One reason the rollout is masked: which call was lost and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_call_id: str = ""
    reason: str = ""


class FreezeAnswer(BaseModel):
    """What a freeze applied at a log position answered: the snapshot version as of that position.

    Later events move the version past it, so a source answering after them still returns the snapshot
    as it was at its freeze, and a drop of that snapshot fails once a write raced it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    position: dict[str, Any]
    version: StrictInt
    incomplete: bool


class RolloutState(BaseModel):
    """Everything the store knows about a rollout besides its entry lines."""

    model_config = ConfigDict(extra="forbid")

    schema_version: StrictInt = STATE_SCHEMA_VERSION
    rollout_id: str
    lifecycle: Lifecycle = Lifecycle.OPEN
    frozen: bool = False
    retired: bool = False
    incomplete: bool = False
    snapshot_id: str | None = None
    version: StrictInt = 0
    entry_digests: dict[str, str] = Field(default_factory=dict)
    indexed_size: StrictInt = 0
    dangling_intents: list[str] = Field(default_factory=list)
    rejections: list[Rejection] = Field(default_factory=list)
    intents: dict[str, IntentOp] = Field(default_factory=dict)
    intents_size: StrictInt = 0
    incomplete_marks: list[IncompleteMark] = Field(default_factory=list)
    incomplete_size: StrictInt = 0
    freeze_answers: list[FreezeAnswer] = Field(default_factory=list)
    last_position: dict[str, Any] | None = None
    removed_records: bool | None = None

    @property
    def is_open(self) -> bool:
        """Writes are accepted only while open."""
        return self.lifecycle is Lifecycle.OPEN

    @property
    def is_pristine(self) -> bool:
        """Nothing has happened to this rollout since it was created or deleted."""
        return (
            self.is_open
            and not self.incomplete
            and not self.entry_digests
            and self.indexed_size == 0
            and self.version == 0
            and not self.rejections
            and not self.intents
            and not self.incomplete_marks
        )

    @property
    def holds_records(self) -> bool:
        """Whether a retire or delete of this rollout would remove anything (an empty open state holds nothing)."""
        return not self.retired and not self.is_pristine

    def answer_at(self, position: LogPosition) -> FreezeAnswer | None:
        """The answer a freeze applied at ``position`` gave, if one did."""
        wanted = position.to_dict()
        for answer in self.freeze_answers:
            if answer.position == wanted:
                return answer
        return None

    def advance(self, lifecycle: Lifecycle) -> None:
        """Move forward in the lifecycle, keeping the plain flags readers of the layout rely on."""
        order = [Lifecycle.OPEN, Lifecycle.FROZEN, Lifecycle.RETIRED]
        if order.index(lifecycle) < order.index(self.lifecycle):
            raise StoreCorruptionError(
                f"rollout {self.rollout_id!r} cannot go from {self.lifecycle} back to {lifecycle}",
                rollout_id=self.rollout_id,
            )
        self.lifecycle = lifecycle
        self.frozen = lifecycle is not Lifecycle.OPEN
        self.retired = lifecycle is Lifecycle.RETIRED

    def already_applied(self, position: LogPosition | None) -> bool:
        """True when an event at this log position was applied before (a resumed materializer)."""
        if position is None or self.last_position is None:
            return False
        return (
            self.last_position.get("topic") == position.topic
            and self.last_position.get("partition") == position.partition
            and int(self.last_position.get("offset", -1)) >= position.offset
        )

    def record_position(self, position: LogPosition | None) -> None:
        """Remember the last applied log position together with what it changed."""
        if position is not None:
            self.last_position = position.to_dict()

    def encode(self) -> bytes:
        """Sorted-key JSON, so replays produce identical bytes."""
        return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def decode(cls, data: bytes, origin: str) -> RolloutState:
        """Parse a state or fence file; newer schemas are refused, damage is reported."""
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise StoreCorruptionError(
                f"{origin} is not valid JSON ({exc}); restore it or delete it"
            ) from exc
        if isinstance(raw, dict):
            version = raw.get("schema_version")
            if isinstance(version, int) and version > STATE_SCHEMA_VERSION:
                raise NewerSchemaError(
                    f"{origin} has schema_version {version}, newer than {STATE_SCHEMA_VERSION}; upgrade tokcap"
                )
        try:
            state = cls.model_validate(raw)
        except ValidationError as exc:
            raise StoreCorruptionError(f"{origin} is not a valid rollout state: {exc}") from exc
        return state

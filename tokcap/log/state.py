"""The typed state of one rollout, as the store keeps it in ``<rollout_id>.tokens.state.json``.

The file is in NeMo Gym 0.7.0's format, so Gym's file store and tokcap's open each other's rollouts:
Gym's seven keys (``frozen``, ``retired``, ``incomplete``, ``snapshot_id``, ``version``, ``entry_digests``,
``indexed_size``) with Gym's meanings, and everything tokcap adds under one ``tokcap`` key, which Gym
carries through its own rewrites. The lifecycle is derived from Gym's flags. Keys neither knows survive.
A state file of tokcap 0.1 (a ``lifecycle`` key at the top) is refused with the upgrade step.

A rollout moves open → frozen → retired and never back; ``delete`` forgets it.
``removed_records`` tells whether the retire or delete that produced this state removed anything.
``version`` counts changes as Gym does: one per accepted entry, per incomplete marker, per conflicting
put and for the first freeze; tokcap also counts each write rejected after the freeze, so a stale
snapshot cannot be dropped.

The state is the commit record of the rollout's side files: ``indexed_size``, ``intents_size`` and
``incomplete_size`` say how many bytes of each file it covers, and ``last_position`` which log position
it reflects. Bytes past those sizes were written after the state and are either folded in (file store)
or cut and applied again (a projection resuming from its log), see ``tokcap.files.recovery``.
``covers_freeze`` says tokcap recorded the freeze, so those sizes cover every line written before it; Gym's
store freezes by setting ``frozen`` alone and never records the intents size, so a frozen state without it
was frozen by Gym.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Annotated, Any

import orjson
from immutables import Map
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    SerializerFunctionWrapHandler,
    StrictInt,
    ValidationError,
    model_serializer,
)

from tokcap.errors import NewerSchemaError, StoreCorruptionError, StoreFormatError
from tokcap.log.events import LogPosition

__all__ = [
    "STATE_SCHEMA_VERSION",
    "UPGRADE_STEP",
    "CommandVerdict",
    "FreezeAnswer",
    "IncompleteMark",
    "IntentOp",
    "Lifecycle",
    "Position",
    "Rejection",
    "RolloutState",
    "StagedSlot",
]

STATE_SCHEMA_VERSION = 5
"""The newest schema of the ``tokcap`` part of a state file this reader understands.

Version 3 records whether tokcap made the freeze (``covers_freeze``) and adds the staging keys (``staged``,
``ledger``, ...), which are written only once a rollout has staged or ledger rows. A reader of version 2 refuses
every version-3 state with the upgrade message instead of misreading it.
Version 4 adds ``command_verdicts``. A state is written with the oldest version that holds it: 4 only once a
command's verdict is recorded, so every other state keeps its bytes and a reader of version 3 refuses only the
states it could not read.
Version 5 adds the log offset of each staged row (``offset`` in a ``staged`` slot), which only a state applied
from a log has; it is written only then.
"""

_SCHEMA_WITH_VERDICTS = 4
_SCHEMA_WITH_STAGED_OFFSETS = 5

_SCHEMA_BEFORE_VERDICTS = 3

Position = Annotated[
    LogPosition, PlainValidator(LogPosition.from_mapping), PlainSerializer(LogPosition.to_dict)
]
"""A log position as the state file holds it: ``LogPosition.to_dict`` (``index`` only when not 0)."""


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
    position: Position | None = None


class IntentOp(enum.StrEnum):
    """The last thing recorded about a dispatched call before its entry."""

    INTENT = "intent"
    CANCEL = "cancel"


class IncompleteMark(BaseModel):
    """One reason the rollout is masked: which call was lost and why.

    ``marker_id`` names a marker a sink may send more than once (a spilled marker forwarded again after a
    lost acknowledgement); it is written only when set, so marks without one keep their bytes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_call_id: str = ""
    reason: str = ""
    marker_id: str = ""

    @model_serializer(mode="wrap")
    def _omit_empty_marker_id(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and not self.marker_id:
            data.pop("marker_id", None)
        return data


class FreezeAnswer(BaseModel):
    """What a freeze applied at a log position answered: the snapshot version as of that position.

    Later events move the version past it, so a source answering after them still returns the snapshot
    as it was at its freeze, and a drop of that snapshot fails once a write raced it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    position: Position
    version: StrictInt
    incomplete: bool


class CommandVerdict(BaseModel):
    """What a drop, retire or delete applied at a log position decided.

    A source in another process than its materializer reads the verdict of its own command here, however many
    events of the rollout were applied after it. ``dropped`` is a drop's answer, ``removed`` a retire's or a
    delete's; the other is not written.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    position: Position
    event_type: str
    dropped: bool | None = None
    removed: bool | None = None

    def dumped(self) -> dict[str, Any]:
        """The verdict as the state file holds it."""
        out: dict[str, Any] = {"event_type": self.event_type, "position": self.position.to_dict()}
        if self.dropped is not None:
            out["dropped"] = self.dropped
        if self.removed is not None:
            out["removed"] = self.removed
        return out


class StagedSlot(BaseModel):
    """Where one staged row or ledger row sits in its file, and the digest of its line.

    A staged row's slot also keeps the staged record's own digest (Gym's ``StagedCallRecord.digest``), which a
    ledger row names as ``staging_digest``: the rules compare the two without reading the row back. Applied from a
    log, a staged row's slot keeps the offset of its stage in the rollout's partition too: the journal's order,
    which ``tokcap.staging.journal`` restages from.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: StrictInt
    length: StrictInt
    digest: str
    record_digest: str | None = None
    offset: StrictInt | None = None

    def dumped(self) -> dict[str, Any]:
        """The slot as the state file holds it; ``record_digest`` and ``offset`` only where there is one."""
        out: dict[str, Any] = {"start": self.start, "length": self.length, "digest": self.digest}
        if self.record_digest is not None:
            out["record_digest"] = self.record_digest
        if self.offset is not None:
            out["offset"] = self.offset
        return out


_GYM_KEYS = frozenset(
    {"entry_digests", "frozen", "incomplete", "indexed_size", "retired", "snapshot_id", "version"}
)
_TOKCAP_KEY = "tokcap"
UPGRADE_STEP = (
    "it was written by tokcap 0.1, whose directory format this version no longer reads; replay the run "
    "topic into an empty directory (`tokcap replay`), or finish and delete its rollouts with tokcap 0.1"
)


class _GymPart(BaseModel):
    """Gym's keys of a state file that must hold a given type (its flags are read as truth values)."""

    snapshot_id: str | None
    version: StrictInt
    entry_digests: dict[str, str]
    indexed_size: StrictInt


class _TokcapPart(BaseModel):
    """What tokcap keeps beyond Gym's keys, under the state file's ``tokcap`` key."""

    model_config = ConfigDict(extra="forbid")

    schema_version: StrictInt = STATE_SCHEMA_VERSION
    dangling_intents: list[str] = Field(default_factory=list)
    rejections: list[Rejection] = Field(default_factory=list)
    intents: dict[str, IntentOp] = Field(default_factory=dict)
    intents_size: StrictInt = 0
    incomplete_marks: list[IncompleteMark] = Field(default_factory=list)
    incomplete_size: StrictInt = 0
    freeze_answers: list[FreezeAnswer] = Field(default_factory=list)
    command_verdicts: list[CommandVerdict] = Field(default_factory=list)
    covers_freeze: bool = False
    last_position: Position | None = None
    removed_records: bool | None = None
    staged: dict[str, StagedSlot] = Field(default_factory=dict)
    staged_size: StrictInt = 0
    ledger: dict[str, StagedSlot] = Field(default_factory=dict)
    ledger_failures: dict[str, str] = Field(default_factory=dict)
    ledger_size: StrictInt = 0


_NO_MAP: Map[Any, Any] = Map()

_MAP_FIELDS = ("intents", "staged", "ledger", "ledger_failures", "foreign_keys")
_TUPLE_FIELDS = ("dangling_intents", "rejections", "incomplete_marks", "freeze_answers", "command_verdicts")


@dataclass(frozen=True)
class RolloutState:
    """Everything the store knows about a rollout besides its entry lines.

    Frozen, with persistent maps and tuples for containers: a rule cannot change the state it was given, only
    return another (``evolve``), and recording one more call costs the same however many there are.
    ``entry_digests`` is the exception: a plain dict behind a read-only type, copied whole when a put adds
    one. Every state write encodes it, and copying a dict costs a tenth of turning a persistent map into one.
    """

    rollout_id: str
    lifecycle: Lifecycle = Lifecycle.OPEN
    frozen: bool = False
    retired: bool = False
    incomplete: bool = False
    snapshot_id: str | None = None
    version: int = 0
    entry_digests: Mapping[str, str] = field(default_factory=dict)
    indexed_size: int = 0
    dangling_intents: tuple[str, ...] = ()
    rejections: tuple[Rejection, ...] = ()
    intents: Map[str, IntentOp] = _NO_MAP
    """The last operation of each call."""
    intents_size: int = 0
    incomplete_marks: tuple[IncompleteMark, ...] = ()
    incomplete_size: int = 0
    freeze_answers: tuple[FreezeAnswer, ...] = ()
    command_verdicts: tuple[CommandVerdict, ...] = ()
    """The verdict of every drop, retire and delete applied from a log, by position; a delete's empty state
    keeps them."""
    covers_freeze: bool = False
    """tokcap recorded the freeze: the sizes cover every line written before it (``tokcap.files.recovery``)."""
    last_position: LogPosition | None = None
    removed_records: bool | None = None
    staged: Map[str, StagedSlot] = _NO_MAP
    """Each staged call's line in ``<id>.tokens.staged``, by staging key; a fetch reads only its lines."""
    staged_size: int = 0
    ledger: Map[str, StagedSlot] = _NO_MAP
    """Each committed call's line in ``<id>.tokens.ledger``, by call id; the digest is the commit's."""
    ledger_failures: Map[str, str] = _NO_MAP
    """Each failed call's reason, by call id; its line is in the ledger file too."""
    ledger_size: int = 0
    foreign_keys: Map[str, Any] = _NO_MAP
    """Top-level keys another writer put in the file; kept so a rewrite never drops them."""

    def __post_init__(self) -> None:
        """A state built from plain dicts and lists keeps them as persistent maps and tuples."""
        if type(self.entry_digests) is not dict:
            object.__setattr__(self, "entry_digests", dict(self.entry_digests))
        for name in _MAP_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, Map):
                object.__setattr__(self, name, Map(value))
        for name in _TUPLE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))

    def evolve(self, **changes: Any) -> RolloutState:
        """This state with ``changes``: how a rule makes the state it returns.

        It copies the instance's fields and sets the changed ones, a third of what ``dataclasses.replace``
        costs, because every event's decision makes at least one (the apply step's hot path). Values must
        already be persistent maps and tuples, as the rules build them.
        """
        if not _FIELD_NAMES.issuperset(changes):
            raise TypeError(f"RolloutState has no field {sorted(changes.keys() - _FIELD_NAMES)}")
        evolved = _new_state()
        values = evolved.__dict__
        values.update(self.__dict__)
        values.update(changes)
        return evolved

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
            and not self.staged
            and not self.ledger
            and not self.ledger_failures
        )

    @property
    def holds_records(self) -> bool:
        """Whether a retire or delete of this rollout would remove anything (an empty open state holds nothing)."""
        return not self.retired and not self.is_pristine

    def answer_at(self, position: LogPosition) -> FreezeAnswer | None:
        """The answer the freeze of the message at ``position`` gave, if one was applied."""
        for answer in self.freeze_answers:
            if answer.position.same_message(position):
                return answer
        return None

    def verdict_at(self, position: LogPosition) -> CommandVerdict | None:
        """The verdict the drop, retire or delete of the message at ``position`` got, if one was applied."""
        for verdict in self.command_verdicts:
            if verdict.position.same_message(position):
                return verdict
        return None

    def advanced(self, lifecycle: Lifecycle, **changes: Any) -> RolloutState:
        """This state moved forward in the lifecycle, Gym's flags (``frozen``, ``retired``) in step."""
        order = [Lifecycle.OPEN, Lifecycle.FROZEN, Lifecycle.RETIRED]
        if order.index(lifecycle) < order.index(self.lifecycle):
            raise StoreCorruptionError(
                f"rollout {self.rollout_id!r} cannot go from {self.lifecycle} back to {lifecycle}",
                rollout_id=self.rollout_id,
            )
        return self.evolve(
            lifecycle=lifecycle,
            frozen=self.frozen or lifecycle is Lifecycle.FROZEN,
            retired=lifecycle is Lifecycle.RETIRED,
            **changes,
        )

    def already_applied(self, position: LogPosition | None) -> bool:
        """True when an event at this log position was applied before (a resumed materializer)."""
        last = self.last_position
        if position is None or last is None:
            return False
        return (
            last.topic == position.topic
            and last.partition == position.partition
            and (last.offset, last.index) >= (position.offset, position.index)
        )

    def positioned(self, position: LogPosition | None) -> RolloutState:
        """This state remembering ``position`` as the last applied one (itself without a log)."""
        return self if position is None else self.evolve(last_position=position)

    def encode(self) -> bytes:
        """Gym's layout: sorted keys, compact, one trailing newline, so replays produce identical bytes.

        The dict is built by hand and handed to orjson (which writes enums as their values): pydantic's dump
        of a state holding thousands of calls was most of the cost of a write.
        """
        tokcap_part = {
            "covers_freeze": self.covers_freeze,
            "dangling_intents": self.dangling_intents,
            "freeze_answers": [answer.model_dump() for answer in self.freeze_answers],
            "incomplete_marks": [mark.model_dump() for mark in self.incomplete_marks],
            "incomplete_size": self.incomplete_size,
            "intents": dict(self.intents),
            "intents_size": self.intents_size,
            "last_position": None if self.last_position is None else self.last_position.to_dict(),
            "rejections": [rejection.model_dump() for rejection in self.rejections],
            "removed_records": self.removed_records,
            "schema_version": _SCHEMA_BEFORE_VERDICTS,
        }
        if self.command_verdicts:
            tokcap_part["command_verdicts"] = [verdict.dumped() for verdict in self.command_verdicts]
            tokcap_part["schema_version"] = _SCHEMA_WITH_VERDICTS
        # Staging keys are written only once a rollout has staged or ledger rows.
        if self.staged or self.staged_size:
            tokcap_part["staged"] = staged = {key: slot.dumped() for key, slot in self.staged.items()}
            tokcap_part["staged_size"] = self.staged_size
            if any("offset" in slot for slot in staged.values()):
                tokcap_part["schema_version"] = _SCHEMA_WITH_STAGED_OFFSETS
        if self.ledger or self.ledger_failures or self.ledger_size:
            tokcap_part["ledger"] = {key: slot.dumped() for key, slot in self.ledger.items()}
            tokcap_part["ledger_failures"] = dict(self.ledger_failures)
            tokcap_part["ledger_size"] = self.ledger_size
        document: dict[str, Any] = {
            **self.foreign_keys,
            "entry_digests": self.entry_digests,
            "frozen": self.frozen,
            "incomplete": self.incomplete,
            "indexed_size": self.indexed_size,
            "retired": self.retired,
            "snapshot_id": self.snapshot_id or "",
            "version": self.version,
            _TOKCAP_KEY: tokcap_part,
        }
        return orjson.dumps(document, option=orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE)

    @classmethod
    def decode(cls, data: bytes, origin: str, rollout_id: str) -> RolloutState:
        """Parse a state file written by tokcap or by Gym; newer schemas are refused, damage is reported."""
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise StoreCorruptionError(
                f"{origin} is not valid JSON ({exc}); restore it or delete it", rollout_id=rollout_id
            ) from exc
        if not isinstance(raw, dict):
            raise StoreCorruptionError(
                f"{origin} is not a JSON object; restore it or delete it", rollout_id=rollout_id
            )
        if "lifecycle" in raw:
            raise StoreFormatError(f"{origin}: {UPGRADE_STEP}", rollout_id=rollout_id)
        extra = raw.get(_TOKCAP_KEY, {})
        if isinstance(extra, dict):
            version = extra.get("schema_version")
            if isinstance(version, int) and version > STATE_SCHEMA_VERSION:
                raise NewerSchemaError(
                    f"{origin} has tokcap schema_version {version}, newer than {STATE_SCHEMA_VERSION}; upgrade tokcap",
                    rollout_id=rollout_id,
                )
        try:
            part = _TokcapPart.model_validate(extra)
            gym = _GymPart.model_validate(
                {
                    "snapshot_id": raw.get("snapshot_id") or None,
                    "version": raw.get("version", 0),
                    "entry_digests": raw.get("entry_digests", {}),
                    "indexed_size": raw.get("indexed_size", 0),
                }
            )
        except ValidationError as exc:
            raise StoreCorruptionError(
                f"{origin} is not a valid rollout state: {exc}", rollout_id=rollout_id
            ) from exc
        frozen, retired = bool(raw.get("frozen", False)), bool(raw.get("retired", False))
        return cls(
            rollout_id=rollout_id,
            lifecycle=Lifecycle.RETIRED if retired else Lifecycle.FROZEN if frozen else Lifecycle.OPEN,
            frozen=frozen,
            retired=retired,
            incomplete=bool(raw.get("incomplete", False)),
            snapshot_id=gym.snapshot_id,
            version=gym.version,
            entry_digests=gym.entry_digests,
            indexed_size=gym.indexed_size,
            **{name: getattr(part, name) for name in _TOKCAP_FIELDS},
            foreign_keys=Map({k: v for k, v in raw.items() if k not in _GYM_KEYS and k != _TOKCAP_KEY}),
        )


_FIELD_NAMES = frozenset(field.name for field in fields(RolloutState))
_TOKCAP_FIELDS = tuple(name for name in _TokcapPart.model_fields if name != "schema_version")
"""The state's fields read from the ``tokcap`` part; ``__post_init__`` makes its lists and dicts persistent."""
_new_state = partial(object.__new__, RolloutState)

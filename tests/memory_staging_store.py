"""An in-memory staging store with Gym's ``StagingSink`` shape, standing in for a trainer's own (TransferQueue).

It keeps every call it was given, exactly as given, so a test can compare what a first stage and a restage
handed it byte for byte. It can refuse chosen keys, raise, or hold a stage until released.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokcap.staging.gym_types import build


@dataclass(frozen=True)
class GivenCall:
    """One ``stage`` call as the store received it: the record's class name and JSON, and the attachments keyword.

    Calls compare by the class's name: a restage builds Gym's class once any test of the session imported Gym,
    whatever class the first stage was given. ``record_class`` is the class itself, for tests that need Gym's.
    """

    record_type: str
    record_json: str
    attachments: dict[str, bytes] | None
    record_class: type = field(compare=False, default=object)


@dataclass
class MemoryStagingStore:
    """Keeps each accepted call by key; ``given`` is every call in the order received, accepted or not."""

    refuse: frozenset[str] = frozenset()
    raise_on: frozenset[str] = frozenset()
    hold: threading.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)
    given: list[GivenCall] = field(default_factory=list)
    stored: dict[str, GivenCall] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        key = f"{record.rollout_id}/{record.model_call_id}"
        call = GivenCall(
            type(record).__name__,
            record.model_dump_json(),
            None if attachments is None else {name: bytes(value) for name, value in attachments.items()},
            type(record),
        )
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(30)
        with self.lock:
            self.given.append(call)
            if key in self.raise_on:
                raise RuntimeError(f"store lost its connection while staging {key}")
            if key in self.refuse:
                return build("StageResult", {"ok": False, "error": f"{key} refused: the store is full"})
            self.stored[key] = call
        return build("StageResult", {"ok": True, "staging_key": key})


class AsyncMemoryStagingStore(MemoryStagingStore):
    """The same store with an ``async def stage``, as an asyncio trainer's store may have."""

    async def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:  # type: ignore[override]
        return MemoryStagingStore.stage(self, record, attachments=attachments)

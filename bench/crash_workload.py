"""What the crash harness's trainer generates and keeps in memory: planned calls and the in-memory staging store.

Every call of the run is a pure function of the seed, its rollout and its index, so the driver that kills the
trainer knows, without asking it, the exact record and attachments each acknowledged call must come back with,
and what generating it again costs. ``InMemoryStagingStore`` stands in for NeMo RL's TransferQueue: Gym's
``StagingSink`` shape, everything in the process's memory, gone with it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson

from tokcap.staging.example_calls import ExampleCall, commit_of, staged_record
from tokcap.staging.gym_types import build

__all__ = [
    "InMemoryStagingStore",
    "Killer",
    "PlannedCall",
    "WorkloadPlan",
    "call_digest",
    "planned_rollout",
    "rollout_of",
]


@dataclass(frozen=True)
class WorkloadPlan:
    """The run's shape, in NeMo RL's terms: rollouts per step, calls per rollout, a snapshot every K steps."""

    seed: int = 7
    steps: int = 8
    rollouts_per_step: int = 4
    calls_per_rollout: int = 3
    save_period: int = 2
    """K: the trainer snapshots after every K-th step."""
    generation_seconds: tuple[float, float] = (20.0, 60.0)
    """The simulated generation time of one call is drawn from this range (seconded, not slept)."""
    sleep_s: float = 0.002
    """What a call sleeps for real, so that concurrent rollouts interleave their stages."""
    generators: int = 4
    """Rollouts generated at once."""

    def to_json(self) -> dict[str, Any]:
        """The plan as the trainer process receives it on its command line."""
        return {
            "seed": self.seed,
            "steps": self.steps,
            "rollouts_per_step": self.rollouts_per_step,
            "calls_per_rollout": self.calls_per_rollout,
            "save_period": self.save_period,
            "generation_seconds": list(self.generation_seconds),
            "sleep_s": self.sleep_s,
            "generators": self.generators,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkloadPlan:
        """The plan a driver wrote with ``to_json``."""
        low, high = data["generation_seconds"]
        return cls(**{**data, "generation_seconds": (float(low), float(high))})


@dataclass(frozen=True)
class PlannedCall:
    """One call of a rollout: the record Gym's worker stages, its attachments, its commit and its cost."""

    key: str
    record: Any
    attachments: dict[str, bytes]
    commit: Any
    generation_seconds: float


def rollout_of(key: str) -> str:
    """The rollout a staging key names."""
    return key.partition("/")[0]


@lru_cache(maxsize=4096)
def planned_rollout(
    seed: int, rollout_id: str, calls: int, low: float, high: float
) -> tuple[PlannedCall, ...]:
    """The rollout's calls, a text root then token-in continuations, each with a known generation time.

    Calls carry what a staged call can carry: routed-expert extras on every second call, an image attachment
    on the root and an empty attachment on the second call.
    """
    rng = random.Random(f"{seed}:{rollout_id}")
    out: list[PlannedCall] = []
    parent: ExampleCall | None = None
    chain: list[str] = []
    for index in range(calls):
        prompt = [rng.randrange(151_000) for _ in range(64 if index == 0 else 16)]
        generated = [rng.randrange(151_000) for _ in range(32)]
        extras = {"routed_experts": f"nrlre1:int16:{len(generated)}x2x2:{rng.randbytes(64).hex()}"}
        record, tokens = staged_record(
            rollout_id, f"c{index}", prompt, generated, parent, extras if index % 2 else None
        )
        attachments = {"image": rng.randbytes(4096)} if index == 0 else {}
        if index == 1:
            attachments["empty"] = b""
        call = ExampleCall(record, tokens, [{"role": "user", "content": f"{rollout_id} turn {index}"}], "ok")
        out.append(
            PlannedCall(
                key=call.key,
                record=record,
                attachments=attachments,
                commit=commit_of(call, chain),
                generation_seconds=round(rng.uniform(low, high), 3),
            )
        )
        chain.append(call.key)
        parent = call
    return tuple(out)


def call_digest(record: Any, attachments: Mapping[str, bytes]) -> str:
    """SHA-256 of a call's record type, every record field and every attachment: equal only when byte-exact."""
    document = {
        "type": type(record).__name__,
        "record": record.model_dump(mode="json"),
        "attachments": {name: base64.b64encode(data).decode() for name, data in sorted(attachments.items())},
    }
    return hashlib.sha256(orjson.dumps(document, option=orjson.OPT_SORT_KEYS)).hexdigest()


class Killer:
    """SIGKILLs this process at the n-th time a named point is reached (``{"stage": 12}``, ...).

    The points: ``stage``, inside the in-memory store's ``stage`` while the trainer generates (the journal has
    the call, the store not yet); ``restage``, the same inside ``restage`` while the trainer restores (not while
    it loads its snapshot's calls); ``cursor``, after the cursor was taken and before the snapshot is written.
    """

    def __init__(self, plan: Mapping[str, int] | None, announce: Callable[[str], None] | None = None) -> None:
        self._left = dict(plan or {})
        self._lock = threading.Lock()
        self._announce = announce

    def reached(self, point: str) -> None:
        """Count one arrival at ``point``; the arrival the plan names does not return."""
        with self._lock:
            if point not in self._left:
                return
            self._left[point] -= 1
            if self._left[point] > 0:
                return
            if self._announce is not None:
                self._announce(point)
            os.kill(os.getpid(), signal.SIGKILL)


class InMemoryStagingStore:
    """NeMo RL's TransferQueue in the harness: Gym's ``StagingSink`` shape, held in memory, lost with the process.

    An identical repeat of a key is ok and changes nothing; a different payload under a staged key is refused,
    as Gym's own stores do. The trainer takes a rollout's calls out when it trains on them.
    """

    def __init__(self, killer: Killer | None = None) -> None:
        self._rows: dict[str, tuple[Any, dict[str, bytes]]] = {}
        self._lock = threading.Lock()
        self._killer = killer or Killer(None)
        self.point = "stage"
        """The kill point a ``stage`` counts as: ``restage`` inside a restage, ``load`` while a snapshot loads."""

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        """Keep the call; ok unless a different payload is already kept under its key."""
        self._killer.reached(self.point)
        key = f"{record.rollout_id}/{record.model_call_id}"
        blobs = {name: bytes(data) for name, data in (attachments or {}).items()}
        with self._lock:
            kept = self._rows.get(key)
            if kept is not None and call_digest(*kept) != call_digest(record, blobs):
                return build("StageResult", {"ok": False, "error": f"{key!r} is kept with another payload"})
            self._rows[key] = (record, blobs)
        return build("StageResult", {"ok": True, "staging_key": key})

    def has(self, key: str) -> bool:
        """Whether a call is kept under ``key``."""
        with self._lock:
            return key in self._rows

    def staged_keys(self) -> list[str]:
        """Every kept key."""
        with self._lock:
            return list(self._rows)

    def take(self, rollout_id: str) -> list[tuple[Any, dict[str, bytes]]]:
        """Remove and return the rollout's calls: what a trainer step consumes."""
        with self._lock:
            keys = [key for key in self._rows if rollout_of(key) == rollout_id]
            return [self._rows.pop(key) for key in keys]

    def digests(self) -> dict[str, str]:
        """Each kept key's ``call_digest``."""
        with self._lock:
            return {key: call_digest(record, blobs) for key, (record, blobs) in self._rows.items()}

    def dumped(self) -> list[dict[str, Any]]:
        """Every kept call as JSON, for the trainer's snapshot."""
        with self._lock:
            rows = list(self._rows.values())
        return [
            {
                "record": record.model_dump(mode="json"),
                "attachments": {name: base64.b64encode(data).decode() for name, data in blobs.items()},
            }
            for record, blobs in rows
        ]

    def load(self, rows: list[dict[str, Any]]) -> None:
        """Stage the calls of a snapshot back in, as a restored trainer does."""
        for row in rows:
            record = build("StagedCallRecord", row["record"])
            blobs = {name: base64.b64decode(text) for name, text in row["attachments"].items()}
            result = self.stage(record, attachments=blobs)
            if not result.ok:
                raise RuntimeError(f"the snapshot's call could not be kept again: {result.error}")

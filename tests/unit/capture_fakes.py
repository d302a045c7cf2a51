"""Sinks that fail on demand, wrapped around the real file store, for the failure chain on the capture path."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokcap.files.store import TokenCaptureStore
from tokcap.log.records import TokenEntry


class InjectedSinkFailure(RuntimeError):
    """The failure a test asked the sink to raise."""


@dataclass
class FlakySink:
    """Delegates to a real store, except the steps a test switched to fail."""

    store: TokenCaptureStore
    fail_begin: bool = False
    fail_put: bool = False
    fail_mark: bool = False
    puts: list[str] = field(default_factory=list)
    marks: list[tuple[str, str]] = field(default_factory=list)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        if self.fail_begin:
            raise InjectedSinkFailure(f"begin_call of {model_call_id} refused")
        await self.store.begin_call(rollout_id, model_call_id)

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> None:
        await self.store.cancel_call(rollout_id, model_call_id)

    async def put(self, entry: TokenEntry) -> None:
        self.puts.append(entry.model_call_id)
        if self.fail_put:
            raise InjectedSinkFailure(f"put of {entry.model_call_id} refused")
        await self.store.put(entry)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        self.marks.append((rollout_id, model_call_id))
        if self.fail_mark:
            raise InjectedSinkFailure(f"mark_incomplete of {rollout_id} refused")
        await self.store.mark_incomplete(rollout_id, model_call_id, "test")

    async def close(self) -> None:
        await self.store.close()


@dataclass
class PutOnlySink:
    """A minimal sink without ``begin_call`` or ``mark_incomplete``, failing every put."""

    puts: list[str] = field(default_factory=list)

    async def put(self, entry: TokenEntry) -> None:
        self.puts.append(entry.model_call_id)
        raise InjectedSinkFailure("put refused")

    async def close(self) -> None:
        return None

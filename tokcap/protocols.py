"""The interfaces between capture, storage and trajectory building.

A ``TokenSink`` receives records where model calls happen.
A ``TokenSource`` freezes, reads and retires them where trainers build.
The file store implements both; a transport may implement either.
Two extensions go beyond Gym's protocols: an ``IntentTokenSink`` also records each call's intent before
dispatch (so a lost entry masks the rollout), and a ``RetiringTokenSource`` also retires and deletes in batches.
Both the file store and the Kafka transport implement them; the capture path uses intents when a sink has them.
This module imports nothing from a server or transport stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tokcap.log.records import ParentResolutionStatus, TokenEntry

__all__ = [
    "CaptureLedger",
    "IntentTokenSink",
    "LineageMatch",
    "LineageResolution",
    "LineageResolver",
    "RetiringTokenSource",
    "RolloutRemovalPayload",
    "TokenCaptureSnapshot",
    "TokenSink",
    "TokenSource",
    "install_lineage_store",
    "install_token_sink",
    "install_token_source",
    "installed_lineage_store",
    "installed_token_sink",
    "installed_token_source",
]


@dataclass(frozen=True)
class TokenCaptureSnapshot:
    """An immutable view of one rollout's frozen capture records.

    ``snapshot_id`` and ``version`` together name the exact frozen state.
    ``incomplete`` is true when any call was lost; the consumer must mask the rollout.
    Entry order carries no meaning.
    """

    rollout_id: str
    entries: tuple[TokenEntry, ...]
    incomplete: bool
    snapshot_id: str
    version: int


@dataclass(frozen=True)
class RolloutRemovalPayload:
    """What a batch ``retire`` or ``delete`` did, rollout by rollout.

    ``removed`` lists rollout ids that had records (or a fence) removed.
    ``not_found`` lists rollout ids that had nothing to remove.
    """

    removed: tuple[str, ...] = field(default_factory=tuple)
    not_found: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, list[str]]:
        """A JSON-friendly form for logs and command output."""
        return {"removed": list(self.removed), "not_found": list(self.not_found)}


@runtime_checkable
class TokenSink(Protocol):
    """Receives captured records through the file store or a transport."""

    async def put(self, entry: TokenEntry) -> None:
        """Durably store one record.

        Repeating a call id with the same payload is a no-op.
        Reusing a call id with a different payload must fail.
        Writing after the rollout is frozen must fail.
        The caller marks the rollout incomplete when this raises.
        """
        ...

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Durably record that a call of this rollout failed to capture.

        The model call still succeeds; this marker is the only durable signal of the hole.
        """
        ...

    async def close(self) -> None:
        """Flush pending work and release resources; calling it again is a no-op."""
        ...


@runtime_checkable
class TokenSource(Protocol):
    """Where a trajectory builder freezes, reads and retires records."""

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze a rollout and return one atomic snapshot.

        Freezing is idempotent.
        No write succeeds after it returns.
        """
        ...

    async def drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        """Retire exactly the consumed snapshot; return ``False`` if the state changed since."""
        ...

    async def close(self) -> None:
        """Release resources; calling it again is a no-op."""
        ...


@dataclass(frozen=True)
class LineageMatch:
    """The one proven parent: its call id and the cumulative tokens a child's prompt starts with (Gym's fields)."""

    model_call_id: str
    cumulative_token_ids: tuple[int, ...]
    digest: str
    staging_chain: tuple[str, ...] = ()
    prev_len: int = 0
    chain_hash: str = ""


@dataclass(frozen=True)
class LineageResolution:
    """One immutable parent decision; a match exactly when the status is RESOLVED (Gym's fields)."""

    status: ParentResolutionStatus
    match: LineageMatch | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if (self.status == ParentResolutionStatus.RESOLVED) != (self.match is not None):
            raise ValueError(
                f"a {self.status.value} lineage resolution must carry a match only when resolved"
            )


@runtime_checkable
class LineageResolver(Protocol):
    """Gym's request-time parent resolver over the entries a sink committed (for example Gym's ``FileLineageStore``).

    tokcap builds one from ``token_id_capture.lineage_store`` and passes it to Gym's middleware untouched;
    ``resolve`` returns Gym's ``LineageResolution``.
    """

    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> Any:
        """Return whether the request is a root, continues one proven parent, or is unresolved."""
        ...

    def is_process_shared(self) -> bool:
        """Whether separate model-server workers see each other's committed entries."""
        ...

    async def close(self) -> None:
        """Release resources; calling it again is a no-op."""
        ...


@runtime_checkable
class CaptureLedger(LineageResolver, Protocol):
    """Gym's token-free ledger of calls whose tokens an inference worker staged (``external_staging``).

    ``record`` returns only once every serving worker can read the row; an identical repeat is a no-op and
    any difference raises. ``record_failure`` rows never resolve a parent and fail the rollout's verification.
    ``manifest`` is plain JSON: committed rows under ``records``, failures under ``failures``.
    ``tokcap.lineage.FileLineageResolver`` is one.
    """

    async def record(self, commit: Any) -> None:
        """Publish a staged call's ledger row (a ``CaptureLedgerCommit``) for parent resolution."""
        ...

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Record a call whose capture did not commit; it poisons the rollout."""
        ...

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's rows and failures, without token arrays."""
        ...

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether the rollout has any row, failure rows counted."""
        ...


@runtime_checkable
class IntentTokenSink(TokenSink, Protocol):
    """A sink that also records, before dispatch, that a call is about to generate.

    A call whose intent is recorded but whose entry never arrives (and is not cancelled) makes the
    rollout's snapshot incomplete, so a lost entry can never go unnoticed.
    """

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record the call's intent; a failure must stop the call before generation."""
        ...

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> None:
        """Close the call's intent when the call ended without generation."""
        ...


@runtime_checkable
class RetiringTokenSource(TokenSource, Protocol):
    """A source that also removes whole rollouts in batches, whatever their state.

    ``drop`` retires one exact snapshot; these retire or delete by id, for cleanup after a run or before reuse.
    """

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove the rollouts' records and keep their fences, so late writes of those attempts keep failing."""
        ...

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemovalPayload:
        """Remove the rollouts' records and fences, so their ids can be reused; deleting again is a no-op."""
        ...


_INSTALLED_SINK: TokenSink | None = None
_INSTALLED_SOURCE: TokenSource | None = None
_INSTALLED_LINEAGE_STORE: LineageResolver | None = None


def install_token_sink(sink: TokenSink | None) -> None:
    """Set (or clear, with ``None``) the process-wide default sink."""
    global _INSTALLED_SINK
    _INSTALLED_SINK = sink


def installed_token_sink() -> TokenSink | None:
    """The process-wide default sink, if one was installed in this process."""
    return _INSTALLED_SINK


def install_token_source(source: TokenSource | None) -> None:
    """Set (or clear) the caller-owned source; tokcap never closes an installed source."""
    global _INSTALLED_SOURCE
    _INSTALLED_SOURCE = source


def installed_token_source() -> TokenSource | None:
    """The caller-owned source installed in this process, if any."""
    return _INSTALLED_SOURCE


def install_lineage_store(store: LineageResolver | None) -> None:
    """Set (or clear) the process-wide request-time lineage store."""
    global _INSTALLED_LINEAGE_STORE
    _INSTALLED_LINEAGE_STORE = store


def installed_lineage_store() -> LineageResolver | None:
    """The lineage store installed in this process, if any."""
    return _INSTALLED_LINEAGE_STORE

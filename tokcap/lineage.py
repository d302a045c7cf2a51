"""Request-time lineage: which recorded call a new request continues, decided as Gym 0.7.0 decides it.

A request with no model-written turn is a ROOT.
Otherwise its ``assistant_fingerprint`` looks up the recorded calls whose own request plus output hashed
to the same value, and each candidate must prove it: the request's first ``continuation_context_len``
items must hash to the candidate's ``continuation_context_digest``.
Exactly one proven candidate is RESOLVED; none or several (with different tokens) stay UNRESOLVED,
because guessing would train one call's tokens as another's prompt.
Candidates with identical cumulative tokens are interchangeable, and the smallest call id wins.
A call id recorded with two different payloads counts as no candidate at all.

``LineageIndex`` is that decision over token-free metadata, so a backend can index a rollout without
holding token arrays and load tokens for the single winner only.
``FileLineageResolver`` serves it over tokcap's file store; ``transports.kafka.lineage`` over Kafka.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokcap.errors import LineageLookupError
from tokcap.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from tokcap.ledger import FileCaptureLedger
from tokcap.records import ParentResolutionStatus, TokenEntry, compute_digest, token_count
from tokcap.store import TokenCaptureStore

__all__ = [
    "FileLineageResolver",
    "LineageIndex",
    "LineageMatch",
    "LineageNode",
    "LineageResolution",
    "materialize_tokens",
    "resolution_of",
    "stamp_continuation",
]

_MAX_CHAIN_DEPTH = 10_000


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


def stamp_continuation(entry: Any, request_items: Sequence[Any]) -> Any:
    """Stamp the lookup metadata a later request finds this call by; mutates and returns the entry.

    Works on tokcap's and Gym's ``TokenEntry`` alike: the fingerprint covers the request plus the call's
    own output items, the context digest and length cover the request alone.
    """
    items = list(request_items)
    entry.continuation_fingerprint = assistant_fingerprint(items + list(entry.output_items))
    entry.continuation_context_len = len(items)
    entry.continuation_context_digest = conversation_digest(items)
    entry.fingerprint_version = FINGERPRINT_VERSION
    return entry


@dataclass(frozen=True)
class LineageNode:
    """What the decision needs of one recorded call; no token arrays.

    ``payload`` identifies the stored payload, so two different payloads under one call id are told apart.
    """

    call_id: str
    fingerprint: str
    context_len: int
    context_digest: str
    cum_len: int
    digest: str
    parent_call_id: str | None
    prompt_is_delta: bool
    payload: str

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], *, token_count: int, payload: str) -> LineageNode | None:
        """The node of one entry given as its field mapping (arrays may be absent); ``None`` if unfindable.

        An entry without a fingerprint, or stamped by another fingerprint version, cannot be matched.
        ``token_count`` is the length of prompt plus generation, used when ``cum_len`` is unset.
        """
        fingerprint = fields.get("continuation_fingerprint") or ""
        version = fields.get("fingerprint_version")
        if not fingerprint or (version is not None and version != FINGERPRINT_VERSION):
            return None
        cum_len = fields.get("cum_len")
        return cls(
            call_id=str(fields["model_call_id"]),
            fingerprint=str(fingerprint),
            context_len=int(fields.get("continuation_context_len") or 0),
            context_digest=str(fields.get("continuation_context_digest") or ""),
            cum_len=int(cum_len) if cum_len is not None else token_count,
            digest=str(fields.get("digest") or ""),
            parent_call_id=fields.get("parent_call_id"),
            prompt_is_delta=bool(fields.get("prompt_is_delta")),
            payload=payload,
        )

    @classmethod
    def of_entry(cls, entry: TokenEntry) -> LineageNode | None:
        """The node of a full stored entry."""
        return cls.from_fields(
            entry.__dict__,
            token_count=token_count(entry),
            payload=entry.payload_digest(),
        )

    def continues(self, request_items: Sequence[Any]) -> bool:
        """Whether the request's leading items are exactly the context this call was made with."""
        if not self.context_digest or len(request_items) < self.context_len:
            return False
        return conversation_digest(list(request_items[: self.context_len])) == self.context_digest


@dataclass
class LineageIndex:
    """One rollout's recorded calls, by call id and by fingerprint, in the order they were added."""

    nodes: dict[str, LineageNode] = field(default_factory=dict)
    by_fingerprint: dict[str, list[str]] = field(default_factory=dict)
    conflicted: set[str] = field(default_factory=set)

    def add(self, node: LineageNode) -> None:
        """Index a call; the same payload again is a no-op, a different one disqualifies the call id."""
        known = self.nodes.get(node.call_id)
        if known is not None:
            if known != node:
                self.conflicted.add(node.call_id)
            return
        self.nodes[node.call_id] = node
        self.by_fingerprint.setdefault(node.fingerprint, []).append(node.call_id)

    def decide(self, request_items: Sequence[Any]) -> tuple[ParentResolutionStatus, LineageNode | None, str]:
        """Gym's decision: ROOT, RESOLVED with the one proven node, or UNRESOLVED with a reason."""
        fingerprint = assistant_fingerprint(request_items)
        if not fingerprint:
            return ParentResolutionStatus.ROOT, None, ""
        proven = [
            self.nodes[call_id]
            for call_id in self.by_fingerprint.get(fingerprint, ())
            if call_id not in self.conflicted and self.nodes[call_id].continues(request_items)
        ]
        if len(proven) > 1 and proven[0].digest and len({(n.digest, n.cum_len) for n in proven}) == 1:
            proven = [min(proven, key=lambda node: node.call_id)]
        if len(proven) != 1:
            return ParentResolutionStatus.UNRESOLVED, None, "ambiguous" if proven else "no_match"
        return ParentResolutionStatus.RESOLVED, proven[0], ""


def materialize_tokens(
    node: LineageNode, index: LineageIndex, load: Callable[[list[str]], list[TokenEntry]]
) -> tuple[int, ...]:
    """The winner's cumulative tokens: its own arrays, or a delta chain walked back to a full anchor.

    ``load`` fetches the stored entries of the given call ids in that order.
    The result must hash to the node's digest (when it has one), else ``LineageLookupError``.
    """
    chain = [node]
    while chain[-1].prompt_is_delta:
        current = chain[-1]
        parent = index.nodes.get(current.parent_call_id or "")
        if parent is None or current.parent_call_id in index.conflicted:
            raise LineageLookupError(
                f"delta record {current.call_id} names parent {current.parent_call_id!r}, which is not "
                "recorded once with one payload; the request stays unresolved"
            )
        if parent in chain or len(chain) >= _MAX_CHAIN_DEPTH:
            raise LineageLookupError(f"the delta chain of call {node.call_id} loops or is too deep")
        chain.append(parent)
    ordered = list(reversed(chain))
    entries = load([item.call_id for item in ordered])
    tokens: list[int] = []
    for expected, entry in zip(ordered, entries, strict=True):
        if entry.model_call_id != expected.call_id or entry.prompt_is_delta != expected.prompt_is_delta:
            raise LineageLookupError(f"the stored entry for call {expected.call_id} disagrees with its index")
        tokens.extend(entry.prompt_token_ids)
        tokens.extend(entry.generation_token_ids)
    if node.digest and compute_digest(tokens) != node.digest:
        raise LineageLookupError(
            f"the tokens of call {node.call_id} do not hash to its recorded digest; the record is damaged "
            "or was rewritten, so the request stays unresolved"
        )
    return tuple(tokens)


def resolution_of(
    status: ParentResolutionStatus, node: LineageNode | None, reason: str, tokens: tuple[int, ...] = ()
) -> LineageResolution:
    """Wrap a decision (and the winner's tokens) as a ``LineageResolution``."""
    if node is None:
        return LineageResolution(status, reason=reason)
    return LineageResolution(
        status,
        match=LineageMatch(
            model_call_id=node.call_id, cumulative_token_ids=tokens, digest=node.digest, prev_len=node.cum_len
        ),
    )


class FileLineageResolver(FileCaptureLedger):
    """Gym's ``LineageResolver`` over a tokcap (or Gym) file-store directory, and its ``CaptureLedger``.

    Each ``resolve`` reads the rollout's accepted entries through ``TokenCaptureStore`` under the rollout's
    lock, so an entry is visible as soon as any process's ``put`` returned, including to a resolver built
    after the put. Retired or deleted rollouts have no entries and resolve nothing.
    Nameable in the config block as ``lineage_store: tokcap.lineage:FileLineageResolver`` with
    ``lineage_store_kwargs: {root: <dir>}``.
    """

    def __init__(self, root: str | Path) -> None:
        self._store = TokenCaptureStore(root)
        self._closed = False

    def __repr__(self) -> str:
        return f"FileLineageResolver(root={str(self._store.root)!r})"

    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> LineageResolution:
        """Return ROOT, RESOLVED with the proven parent's cumulative tokens, or UNRESOLVED with a reason."""
        return await asyncio.to_thread(self.resolve_now, rollout_id, request_items)

    def resolve_now(self, rollout_id: str, request_items: Sequence[Any]) -> LineageResolution:
        """The blocking form of ``resolve``."""
        if not assistant_fingerprint(request_items):
            return LineageResolution(ParentResolutionStatus.ROOT)
        entries = {entry.model_call_id: entry for entry in self._store.read_entries(rollout_id)}
        index = LineageIndex()
        for entry in entries.values():
            node = LineageNode.of_entry(entry)
            if node is not None:
                index.add(node)
        status, node, reason = index.decide(request_items)
        if status is ParentResolutionStatus.UNRESOLVED:
            staged = self.staged_resolution(rollout_id, request_items)
            if staged is not None:
                return staged
        if node is None:
            return resolution_of(status, None, reason)
        tokens = materialize_tokens(node, index, lambda ids: [entries[call_id] for call_id in ids])
        return resolution_of(status, node, reason, tokens)

    def is_process_shared(self) -> bool:
        """True: every process on this directory sees every accepted entry."""
        return True

    async def close(self) -> None:
        """Release the store handle; calling it again is a no-op."""
        if not self._closed:
            self._closed = True
            await self._store.close()

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
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokcap.errors import ConfigError, LineageLookupError
from tokcap.files.store import AcceptedEntries, TokenCaptureStore
from tokcap.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from tokcap.ledger import FileCaptureLedger
from tokcap.log.records import (
    ParentResolutionStatus,
    TokenEntry,
    digest_of_packed,
    entry_digest,
    pack_token_ids,
    token_count,
)
from tokcap.metrics import source_timed
from tokcap.protocols import LineageMatch, LineageResolution

__all__ = [
    "FileLineageResolver",
    "KeptParents",
    "LineageIndex",
    "LineageMatch",
    "LineageNode",
    "LineageResolution",
    "Materialized",
    "materialize_tokens",
    "resolution_of",
    "stamp_continuation",
]

_MAX_CHAIN_DEPTH = 10_000


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

    def decide(
        self, request_items: Sequence[Any], fingerprint: str | None = None
    ) -> tuple[ParentResolutionStatus, LineageNode | None, str]:
        """Gym's decision: ROOT, RESOLVED with the one proven node, or UNRESOLVED with a reason.

        ``fingerprint`` is the request's ``assistant_fingerprint`` when the caller has it already (it hashes
        every model-written turn, so computing it twice doubles the cost of a long rollout's resolve).
        """
        if fingerprint is None:
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


@dataclass(frozen=True)
class Materialized:
    """One recorded call's cumulative tokens, checked against its digest, and their packing (``pack_token_ids``).

    A resolver keeps the last one of each rollout: the next continuation's parent extends it, so only the
    records added since are loaded and packed. The digest still hashes the whole sequence, as it is defined.
    """

    call_id: str
    tokens: tuple[int, ...]
    packed: bytes


def materialize_tokens(
    node: LineageNode,
    index: LineageIndex,
    load: Callable[[list[str]], list[TokenEntry]],
    known: Materialized | None = None,
) -> Materialized:
    """The winner's cumulative tokens: its own arrays, or a delta chain walked back to a full anchor.

    ``load`` fetches the stored entries of the given call ids in that order. ``known``, a call of the same
    index materialized before, ends the walk where the chain reaches it.
    The result must hash to the node's digest (when it has one), else ``LineageLookupError``.
    """
    if known is not None and known.call_id == node.call_id:
        return known
    chain = [node]
    base: Materialized | None = None
    while chain[-1].prompt_is_delta:
        current = chain[-1]
        parent = index.nodes.get(current.parent_call_id or "")
        if parent is None or current.parent_call_id in index.conflicted:
            raise LineageLookupError(
                f"delta record {current.call_id} names parent {current.parent_call_id!r}, which is not "
                "recorded once with one payload; the request stays unresolved"
            )
        if known is not None and parent.call_id == known.call_id:
            base = known
            break
        if parent in chain or len(chain) >= _MAX_CHAIN_DEPTH:
            raise LineageLookupError(f"the delta chain of call {node.call_id} loops or is too deep")
        chain.append(parent)
    ordered = list(reversed(chain))
    entries = load([item.call_id for item in ordered])
    added: list[int] = []
    for expected, entry in zip(ordered, entries, strict=True):
        if entry.model_call_id != expected.call_id or entry.prompt_is_delta != expected.prompt_is_delta:
            raise LineageLookupError(f"the stored entry for call {expected.call_id} disagrees with its index")
        added.extend(entry.prompt_token_ids)
        added.extend(entry.generation_token_ids)
    if base is None:
        tokens, packed = tuple(added), pack_token_ids(added)
    else:
        tokens, packed = base.tokens + tuple(added), base.packed + pack_token_ids(added)
    if node.digest and digest_of_packed(packed) != node.digest:
        raise LineageLookupError(
            f"the tokens of call {node.call_id} do not hash to its recorded digest; the record is damaged "
            "or was rewritten, so the request stays unresolved"
        )
    return Materialized(node.call_id, tokens, packed)


class KeptParents:
    """The last materialized parent of each rollout, bounded in tokens overall, the least recently used forgotten.

    Each is kept with its owner, the per-rollout state it was built from (an index and what it read); it is
    handed back only to that same owner, so a rollout read afresh (deleted, rewritten) never reuses it.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ConfigError(f"max_kept_tokens must not be negative, got {max_tokens}; 0 keeps no parent")
        self._max_tokens = max_tokens
        self._tokens = 0
        self._kept: dict[str, tuple[object, Materialized]] = {}
        self._lock = threading.Lock()

    def get(self, rollout_id: str, owner: object) -> Materialized | None:
        """The rollout's kept parent if ``owner`` kept it."""
        with self._lock:
            kept = self._kept.get(rollout_id)
            return kept[1] if kept is not None and kept[0] is owner else None

    def keep(self, rollout_id: str, owner: object, materialized: Materialized) -> None:
        """Keep ``materialized`` as the rollout's parent, in place of the one kept before."""
        with self._lock:
            self._forget(rollout_id)
            if len(materialized.tokens) > self._max_tokens:
                return
            self._kept[rollout_id] = (owner, materialized)
            self._tokens += len(materialized.tokens)
            while self._tokens > self._max_tokens:
                self._forget(next(iter(self._kept)))

    def forget(self, rollout_id: str) -> None:
        """Forget the rollout's kept parent."""
        with self._lock:
            self._forget(rollout_id)

    def clear(self) -> None:
        """Forget every kept parent."""
        with self._lock:
            self._kept.clear()
            self._tokens = 0

    def _forget(self, rollout_id: str) -> None:
        kept = self._kept.pop(rollout_id, None)
        if kept is not None:
            self._tokens -= len(kept[1].tokens)


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


_KEPT_PARENT_TOKENS = 8_000_000
"""Tokens of materialized parents a resolver keeps across its rollouts (Gym's bound)."""

_KEPT_ROLLOUTS = 65_536
"""Rollouts whose read index a file resolver keeps (Gym's bound); the least recently resolved are forgotten."""


@dataclass
class _ReadSoFar:
    """What a file resolver read of one rollout's entries file: the index, and where each call's line is."""

    identity: tuple[int, int] | None
    offset: int = 0
    index: LineageIndex = field(default_factory=LineageIndex)
    lines: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Start and end of each call's first line: where its tokens are read again if it is on a winner's chain."""
    digests: dict[str, str] = field(default_factory=dict)
    """sha256 of each call's first line, as the rollout's state records it while the file is the one read."""

    def describes(self, accepted: AcceptedEntries) -> bool:
        """Whether the file still holds exactly what was read: same file, not shorter, same line per call."""
        if accepted.identity != self.identity or accepted.size < self.offset:
            return False
        digests = accepted.digests
        return all(digests.get(call_id) == digest for call_id, digest in self.digests.items())

    def read_on(self, accepted: AcceptedEntries) -> dict[str, TokenEntry]:
        """Index the complete lines appended since the last read; return their entries by call id."""
        data = accepted.read(self.offset, accepted.size)
        end = data.rfind(b"\n") + 1
        fresh: dict[str, TokenEntry] = {}
        start = self.offset
        for line in data[:end].split(b"\n")[:-1]:
            line_start, start = start, start + len(line) + 1
            if not line:
                continue
            entry = TokenEntry.from_json(line)
            node = LineageNode.of_entry(entry)
            if entry.model_call_id not in self.lines:
                self.lines[entry.model_call_id] = (line_start, start - 1)
                self.digests[entry.model_call_id] = entry_digest(line)
                fresh[entry.model_call_id] = entry
            if node is not None:
                self.index.add(node)
        self.offset += end
        return fresh

    def load(
        self, accepted: AcceptedEntries, fresh: Mapping[str, TokenEntry], call_ids: list[str]
    ) -> list[TokenEntry]:
        """The entries of the given calls: the ones just read as they are, the others read again by position."""
        entries = []
        for call_id in call_ids:
            entry = fresh.get(call_id)
            if entry is None:
                start, end = self.lines[call_id]
                line = accepted.read(start, end)
                if entry_digest(line) != self.digests[call_id]:
                    raise LineageLookupError(
                        f"the line of call {call_id} changed since it was read; the request stays unresolved"
                    )
                entry = TokenEntry.from_json(line)
            entries.append(entry)
        return entries


class FileLineageResolver(FileCaptureLedger):
    """Gym's ``LineageResolver`` over a tokcap (or Gym) file-store directory, and its ``CaptureLedger``.

    Each ``resolve`` reads the rollout's accepted entries through ``TokenCaptureStore`` under the rollout's
    lock, so an entry is visible as soon as any process's ``put`` returned, including to a resolver built
    after the put. Retired or deleted rollouts have no entries and resolve nothing.

    A resolve costs what was appended since the rollout's last resolve: the resolver keeps each rollout's
    index with the file's identity and the bytes read, and the last parent it materialized. What it kept is
    read afresh when the file is another file, shorter, or its state records another line for a call read.
    Nameable in the config block as ``lineage_store: tokcap.lineage:FileLineageResolver`` with
    ``lineage_store_kwargs: {root: <dir>}``.
    """

    def __init__(self, root: str | Path, *, max_kept_tokens: int = _KEPT_PARENT_TOKENS) -> None:
        self._store = TokenCaptureStore(root)
        self._read: dict[str, _ReadSoFar] = {}
        self._read_lock = threading.Lock()
        self._parents = KeptParents(max_kept_tokens)
        self._closed = False

    def __repr__(self) -> str:
        return f"FileLineageResolver(root={str(self._store.root)!r})"

    @source_timed("file", "resolve")
    async def resolve(self, rollout_id: str, request_items: list[dict[str, Any]]) -> LineageResolution:
        """Return ROOT, RESOLVED with the proven parent's cumulative tokens, or UNRESOLVED with a reason."""
        return await asyncio.to_thread(self.resolve_now, rollout_id, request_items)

    def resolve_now(self, rollout_id: str, request_items: Sequence[Any]) -> LineageResolution:
        """The blocking form of ``resolve``."""
        fingerprint = assistant_fingerprint(request_items)
        if not fingerprint:
            return LineageResolution(ParentResolutionStatus.ROOT)
        # The rollout's lock serializes this rollout's resolves (and its writers); others go on meanwhile.
        with self._store.accepted_entries(rollout_id) as accepted:
            read = self._read_so_far(rollout_id, accepted)
            try:
                fresh = read.read_on(accepted)
            except BaseException:
                self._forget(rollout_id)  # a line that cannot be read is read again next time, from the start
                raise
            status, node, reason = read.index.decide(request_items, fingerprint)
            if node is not None:
                known = self._parents.get(rollout_id, read)
                materialized = materialize_tokens(
                    node, read.index, lambda ids: read.load(accepted, fresh, ids), known
                )
                if materialized is not known:
                    self._parents.keep(rollout_id, read, materialized)
                return resolution_of(status, node, reason, materialized.tokens)
        # Outside the rollout's lock: the staged rows are read under it again.
        if status is ParentResolutionStatus.UNRESOLVED:
            staged = self.staged_resolution(rollout_id, request_items)
            if staged is not None:
                return staged
        return resolution_of(status, None, reason)

    def _forget(self, rollout_id: str) -> None:
        with self._read_lock:
            self._read.pop(rollout_id, None)
        self._parents.forget(rollout_id)

    def _read_so_far(self, rollout_id: str, accepted: AcceptedEntries) -> _ReadSoFar:
        """The rollout's kept reading if it still describes the file, else a fresh one (kept in its place)."""
        with self._read_lock:
            read = self._read.pop(rollout_id, None)
        # Checked outside the resolver-wide lock (it grows with the rollout): the caller holds the rollout's lock,
        # so no other resolve of this rollout uses its reading meanwhile.
        if read is None or not read.describes(accepted):
            self._parents.forget(rollout_id)
            read = _ReadSoFar(accepted.identity)
        with self._read_lock:
            self._read[rollout_id] = read
            while len(self._read) > _KEPT_ROLLOUTS:
                oldest = next(iter(self._read))
                del self._read[oldest]
                self._parents.forget(oldest)
            return read

    def is_process_shared(self) -> bool:
        """True: every process on this directory sees every accepted entry."""
        return True

    async def close(self) -> None:
        """Release the store handle; calling it again is a no-op."""
        if not self._closed:
            self._closed = True
            with self._read_lock:
                self._read.clear()
            self._parents.clear()
            await self._store.close()

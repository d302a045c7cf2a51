"""Trajectories from a frozen snapshot, independent of the order of its entries.

A ``Chain`` is a path of model calls in which each call's prompt is the previous call's prompt and
generation followed by interstitial tokens (tool output, the next user turn, a chat template's glue).
Training on a chain gives loss mask 1 to generated tokens and 0 to prompt and interstitial tokens.

Two builders:

- ``prefix_merging``: one tree per independent conversation, one chain per leaf; one main chain is delivered.
- ``per_request``: one single-link chain per call; not suitable for single-response delivery.

Both sort their input first, so a shuffled snapshot builds the same chains.

A snapshot whose records carry lineage (Gym 0.7.0's ``parent_resolution``, ``parent_call_id``, ``digest``,
``prompt_is_delta``) is built by Gym's rules: delta prompts are rebuilt first (``tokcap.delta_records``),
each call joins only the parent its record names and only when the digest proves it, and whatever cannot
be rebuilt or proven is left out and named in the notes. A snapshot without lineage (tokcap 0.1's records)
is built by prefix matching alone.
Nothing here recurses: a chain of any depth builds in loops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokcap.chains import BuildNotes, BuildOutput, Chain, ChainLink, ChainTokens
from tokcap.delta_records import rebuild_full_prompts
from tokcap.errors import TrajectoryBuildError, UnknownBuilderError
from tokcap.log.records import ParentResolutionStatus, TokenEntry, compute_digest
from tokcap.prefix_trie import PrefixTrie

if TYPE_CHECKING:
    from tokcap.response_items import (
        assert_prefix_contiguity,
        project_chain_to_output_items,
        project_main_chain_response,
    )

__all__ = [
    "BUILDERS",
    "PER_REQUEST",
    "PREFIX_MERGING",
    "BuildNotes",
    "BuildOutput",
    "Builder",
    "Chain",
    "ChainLink",
    "ChainTokens",
    "assert_prefix_contiguity",
    "per_request",
    "prefix_merging",
    "project_chain_to_output_items",
    "project_main_chain_response",
    "run_builder",
]

PREFIX_MERGING = "prefix_merging"
PER_REQUEST = "per_request"


Builder = Callable[[Iterable[TokenEntry]], BuildOutput]


def _unique_entries(entries: Iterable[TokenEntry]) -> list[TokenEntry]:
    """One entry per call id; an exact repeat is dropped, a conflicting one cannot be built."""
    by_call: dict[str, TokenEntry] = {}
    for entry in entries:
        known = by_call.get(entry.model_call_id)
        if known is None:
            by_call[entry.model_call_id] = entry
        elif known != entry:
            raise TrajectoryBuildError(
                f"call {entry.model_call_id!r} of rollout {entry.rollout_id!r} appears twice with different "
                "payloads; the snapshot is inconsistent",
                rollout_id=entry.rollout_id,
                model_call_id=entry.model_call_id,
            )
    return list(by_call.values())


def _creation_key(entry: TokenEntry) -> tuple[float, str]:
    return (entry.created_at, entry.model_call_id)


@dataclass(eq=False)
class _CallNode:
    """A call in the build tree; ``context_start`` is where its interstitial tokens begin in its prompt."""

    entry: TokenEntry
    parent: _CallNode | None
    context_start: int
    quarantined: bool = False
    discarded: bool = False
    children: list[_CallNode] = field(default_factory=list)

    def link(self) -> ChainLink:
        if self.parent is None:
            return ChainLink(self.entry)
        return ChainLink(self.entry, tuple(self.entry.prompt_token_ids[self.context_start :]))


def _attach_to_parents(ordered: Sequence[TokenEntry]) -> list[_CallNode]:
    """Give each call, shortest prompt first, the earlier call whose full sequence is its longest prefix.

    Several identical candidate parents make the call and those candidates quarantined;
    quarantine passes to every call that extends a quarantined one.
    """
    trie: PrefixTrie[_CallNode] = PrefixTrie()
    nodes: list[_CallNode] = []
    for entry in ordered:
        match = trie.longest_prefix(entry.prompt_token_ids)
        if match is None:
            node = _CallNode(entry, None, 0)
        else:
            parent = match.values[0]
            node = _CallNode(entry, parent, match.length)
            if len(match.values) > 1:
                node.quarantined = True
                for candidate in match.values:
                    candidate.quarantined = True
            elif parent.quarantined:
                node.quarantined = True
        trie.insert(entry.prompt_token_ids + entry.generation_token_ids, node)
        nodes.append(node)
    for node in nodes:
        if not node.quarantined and node.parent is not None:
            node.parent.children.append(node)
    return nodes


def _resolve_retries(nodes: Sequence[_CallNode]) -> tuple[list[tuple[str, ...]], list[str]]:
    """Among siblings with identical prompts keep the extended ones, or one when none is extended.

    Return the unresolved groups (every id, sorted) and the discarded call ids (sorted).
    """
    groups: dict[tuple[str, tuple[int, ...]], list[_CallNode]] = {}
    for node in nodes:
        if node.quarantined:
            continue
        parent_id = node.parent.entry.model_call_id if node.parent is not None else ""
        key = (parent_id, tuple(node.entry.prompt_token_ids[node.context_start :]))
        groups.setdefault(key, []).append(node)
    unresolved: list[tuple[str, ...]] = []
    discarded: list[str] = []
    for group in groups.values():
        if len(group) < 2:
            continue
        extended = [node for node in group if node.children]
        if extended:
            dropped = [node for node in group if not node.children]
        else:
            kept = max(group, key=lambda node: _creation_key(node.entry))
            dropped = [node for node in group if node is not kept]
            unresolved.append(tuple(sorted(node.entry.model_call_id for node in group)))
        for node in dropped:
            node.discarded = True
            discarded.append(node.entry.model_call_id)
    return sorted(unresolved), sorted(discarded)


def _chain_ending_at(leaf: _CallNode) -> Chain:
    """Walk from a leaf up to its root, iteratively, and lay the path out root first."""
    path: list[_CallNode] = []
    node: _CallNode | None = leaf
    while node is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    root = path[0]
    return Chain(
        chain_id=leaf.entry.model_call_id,
        root_prompt_token_ids=tuple(root.entry.prompt_token_ids),
        links=tuple(node.link() for node in path),
    )


def _chain_order_key(chain: Chain) -> tuple[tuple[float, str], ...]:
    """Earliest-created root first; among chains sharing a root, the earliest-created branch at the fork."""
    return tuple(_creation_key(link.entry) for link in chain.links)


def _check_stored_digests(entries: list[TokenEntry]) -> list[TokenEntry]:
    """Refuse a snapshot without lineage whose record carries a ``digest`` or ``cum_len`` its tokens contradict.

    Such a snapshot has no delta prompts (a delta needs a RESOLVED parent, which is lineage), so each
    record's own tokens are its whole sequence. Guessing past a mismatch would train on wrong tokens, so
    ``TrajectoryBuildError`` is raised and the consumer masks the rollout.
    """
    for entry in entries:
        sequence = [*entry.prompt_token_ids, *entry.generation_token_ids]
        if entry.digest is not None and compute_digest(sequence) != entry.digest:
            raise TrajectoryBuildError(
                f"call {entry.model_call_id!r}: its prompt and generation do not match its stored digest; "
                "the record is inconsistent",
                rollout_id=entry.rollout_id,
                model_call_id=entry.model_call_id,
            )
        if entry.cum_len is not None and entry.cum_len != len(sequence):
            raise TrajectoryBuildError(
                f"call {entry.model_call_id!r}: its sequence has {len(sequence)} tokens, its cum_len says "
                f"{entry.cum_len}",
                rollout_id=entry.rollout_id,
                model_call_id=entry.model_call_id,
            )
    return entries


def _split_empty_generations(entries: Iterable[TokenEntry]) -> tuple[list[TokenEntry], tuple[str, ...]]:
    """Full-prompt records, split into those that generated tokens and the ids of those that did not.

    With lineage, delta prompts are rebuilt and whatever cannot be rebuilt or verified is left out.
    """
    unique = _unique_entries(entries)
    rebuilt = rebuild_full_prompts(unique).entries if _has_lineage(unique) else _check_stored_digests(unique)
    unique = list(rebuilt)
    producing = [entry for entry in unique if entry.generation_token_ids]
    empty = tuple(sorted(entry.model_call_id for entry in unique if not entry.generation_token_ids))
    return producing, empty


# --- Lineage builds: the parent each record names, proven by digest (Gym 0.7.0's rules) ---

_RECOVERED = "parent_call_id_missing_recovered"


def _has_lineage(entries: Sequence[TokenEntry]) -> bool:
    """A snapshot carries lineage when any record states a parent decision or stores a delta prompt."""
    return any(
        entry.parent_resolution is not None or entry.prompt_is_delta or entry.parent_call_id is not None
        for entry in entries
    )


def _first_of_each_call(entries: Iterable[TokenEntry]) -> tuple[list[TokenEntry], list[str]]:
    """One entry per call id, the first seen; a later copy with other tokens is a conflict, named once each."""
    by_call: dict[str, TokenEntry] = {}
    conflicts: list[str] = []
    for entry in entries:
        known = by_call.get(entry.model_call_id)
        if known is None:
            by_call[entry.model_call_id] = entry
        elif (known.prompt_token_ids, known.generation_token_ids) != (
            entry.prompt_token_ids,
            entry.generation_token_ids,
        ):
            conflicts.append(entry.model_call_id)
    return list(by_call.values()), conflicts


@dataclass(eq=False)
class _LineageNode:
    """A call in a lineage build; ``sequence`` is its full prompt and generation."""

    entry: TokenEntry
    sequence: list[int]
    parent: _LineageNode | None = None
    children: list[_LineageNode] = field(default_factory=list)
    quarantined: bool = False
    boundary: bool = False


def _proven_parent(
    node: _LineageNode, placed: Mapping[str, _LineageNode], trie: PrefixTrie[_LineageNode] | None
) -> tuple[_LineageNode | None, str | None]:
    """The parent this call may join, and the note saying why its recorded link was not used as recorded.

    ROOT has none. UNRESOLVED has none (``parent_unresolved``). A named parent must already be placed
    (its prompt is shorter) and the child's prompt must start with tokens whose digest is the parent's.
    A named parent missing from the build (it generated nothing, or was lost) is replaced only by the one
    placed call whose full sequence is the longest prefix of the prompt, if exactly one call has it.
    """
    entry = node.entry
    status = entry.parent_resolution
    if status == ParentResolutionStatus.ROOT:
        return None, None
    if status == ParentResolutionStatus.UNRESOLVED:
        return None, "parent_unresolved"
    claimed = entry.parent_call_id
    if status is None and claimed is None:
        return None, "missing_resolution"
    if claimed is None:
        return None, "resolved_parent_missing_id"
    parent = placed.get(claimed)
    if parent is None:
        match = trie.longest_prefix(entry.prompt_token_ids) if trie is not None else None
        if match is not None and len(match.values) == 1:
            return match.values[0], _RECOVERED
        return None, "parent_call_id_missing"
    length = parent.entry.cum_len if parent.entry.cum_len is not None else len(parent.sequence)
    expected = parent.entry.digest or compute_digest(parent.sequence)
    prompt = entry.prompt_token_ids
    if length <= len(prompt) and compute_digest(prompt[:length]) == expected:
        return parent, None
    return None, "parent_digest_mismatch"


def _resolve_lineage_retries(
    nodes: Sequence[_LineageNode], on_terminal_path: set[int], terminal_known: bool
) -> list[tuple[str, ...]]:
    """Same-prompt siblings (under one parent, or all among roots) are retries; keep one, quarantine the rest.

    The sibling on the verified terminal's path is kept; else the ones a later call extends; else the
    smallest call id, and the group is unresolved (masking the rollout) unless a terminal was attributed,
    because then the group cannot reach the delivered chain. Groups are judged in build order.
    """
    by_parent: dict[int, list[_LineageNode]] = {}
    for node in nodes:
        by_parent.setdefault(id(node.parent) if node.parent is not None else 0, []).append(node)
    unresolved: list[tuple[str, ...]] = []
    for siblings in by_parent.values():
        by_prompt: dict[tuple[int, ...], list[_LineageNode]] = {}
        for node in siblings:
            by_prompt.setdefault(tuple(node.entry.prompt_token_ids), []).append(node)
        for group in by_prompt.values():
            if len(group) < 2:
                continue
            keep = [node for node in group if id(node) in on_terminal_path]
            if not keep:
                keep = [node for node in group if any(not child.quarantined for child in node.children)]
            if not keep:
                keep = [min(group, key=lambda node: node.entry.model_call_id)]
                if not terminal_known:
                    unresolved.append(tuple(node.entry.model_call_id for node in group))
            for node in group:
                if node not in keep:
                    node.quarantined = True
    return unresolved


def _lineage_path(node: _LineageNode) -> list[_LineageNode]:
    path: list[_LineageNode] = []
    current: _LineageNode | None = node
    while current is not None:
        path.append(current)
        current = current.parent
    path.reverse()
    return path


def _lineage_chain(path: Sequence[_LineageNode]) -> Chain:
    links: list[ChainLink] = []
    previous: list[int] = []
    for step, node in enumerate(path):
        interstitial = () if step == 0 else tuple(node.entry.prompt_token_ids[len(previous) :])
        links.append(ChainLink(node.entry, interstitial))
        previous = node.sequence
    return Chain(
        chain_id=path[-1].entry.model_call_id,
        root_prompt_token_ids=tuple(path[0].entry.prompt_token_ids),
        links=tuple(links),
    )


def _lineage_merging(entries: Sequence[TokenEntry], terminal_call_id: str | None) -> BuildOutput:
    """Join calls along the parent links their records name, each proven by digest; see ``prefix_merging``."""
    unique, conflicts = _first_of_each_call(entries)
    rebuilt = rebuild_full_prompts(unique)
    failures: dict[str, int] = {}
    unresolved_parents: list[str] = []

    def note(reason: str, call_id: str) -> None:
        failures[reason] = failures.get(reason, 0) + 1
        if reason != _RECOVERED:
            unresolved_parents.append(call_id)

    empty = tuple(entry.model_call_id for entry in rebuilt.entries if not entry.generation_token_ids)
    producing = [entry for entry in rebuilt.entries if entry.generation_token_ids]
    # Gym reports conflicting duplicates only when something is left to build; nothing is delivered anyway.
    for call_id in conflicts if producing else []:
        note("duplicate_call_id_conflict", call_id)
    for call_id in rebuilt.mismatched:
        note("digest_mismatch", call_id)
    for call_id in rebuilt.broken:
        note("delta_chain_unreconstructable", call_id)
    ordered = sorted(producing, key=lambda entry: (len(entry.prompt_token_ids), entry.model_call_id))
    present = {entry.model_call_id for entry in ordered}
    needs_trie = any(
        entry.parent_call_id is not None and entry.parent_call_id not in present for entry in ordered
    )
    trie: PrefixTrie[_LineageNode] | None = PrefixTrie() if needs_trie else None
    placed: dict[str, _LineageNode] = {}
    nodes: list[_LineageNode] = []
    roots = 0
    for entry in ordered:
        node = _LineageNode(entry, [*entry.prompt_token_ids, *entry.generation_token_ids])
        parent, reason = _proven_parent(node, placed, trie)
        if reason is not None:
            note(reason, entry.model_call_id)
            node.boundary = reason != _RECOVERED
        if parent is None:
            roots += 1
        else:
            node.parent = parent
            parent.children.append(node)
        nodes.append(node)
        if trie is not None:
            trie.insert(node.sequence, node)
        placed[entry.model_call_id] = node

    terminal = placed.get(terminal_call_id) if terminal_call_id else None
    terminal_path = _lineage_path(terminal) if terminal is not None else []
    unresolved = _resolve_lineage_retries(nodes, {id(node) for node in terminal_path}, terminal is not None)

    terminal_chain = ""
    main: Chain | None = None
    if terminal_call_id:
        if terminal is None:
            terminal_chain = "not_captured"
        elif any(node.quarantined or node.boundary for node in terminal_path):
            terminal_chain = "broken"
        else:
            terminal_chain = "delivered"
            main = _lineage_chain(terminal_path)
    others: list[Chain] = []
    for leaf in (node for node in nodes if not node.children):
        path = _lineage_path(leaf)
        if any(node.quarantined for node in path) or (main is not None and terminal in path):
            continue
        others.append(_lineage_chain(path))
    if main is None and others:
        main = min(others, key=lambda chain: _creation_key(chain.links[0].entry))
    chains = [main, *(chain for chain in others if chain is not main)] if main is not None else []
    notes = BuildNotes(
        builder=PREFIX_MERGING,
        roots=roots,
        chains=len(chains),
        generated_tokens_captured=sum(len(entry.generation_token_ids) for entry in producing),
        generated_tokens_delivered=main.generated_token_count if main is not None else 0,
        unresolved_retries=tuple(unresolved),
        discarded_retries=tuple(sorted(node.entry.model_call_id for node in nodes if node.quarantined)),
        empty_generation_calls=empty,
        terminal_call_id=terminal_call_id,
        terminal_chain=terminal_chain,
        lineage=True,
        parent_link_failures=failures,
        unresolved_parent_calls=tuple(unresolved_parents),
    )
    return BuildOutput(
        chains=tuple(chains),
        notes=notes,
        main_chain_id=main.chain_id if main is not None else None,
        branch_chain_ids=tuple(chain.chain_id for chain in chains[1:]),
        quarantined_call_ids=tuple(sorted(node.entry.model_call_id for node in nodes if node.quarantined)),
    )


def prefix_merging(entries: Iterable[TokenEntry], terminal_call_id: str | None = None) -> BuildOutput:
    """Merge calls whose prompts extend earlier calls into trees, and deliver one main chain.

    Calls are processed by increasing prompt length (ties by call id).
    A call's parent is the earlier call whose prompt plus generation is the longest prefix of its prompt;
    a prompt that extends no earlier call starts a new root.
    Identical candidate parents are ambiguous: that subtree is quarantined.
    Siblings with identical prompts are retries: the extended one is kept; if none is, the latest-created
    one is kept and the group is reported as unresolved.
    Calls with no generated tokens are excluded and reported.
    Every root-to-leaf path is a chain; the main chain is the one whose root was created first (ties by
    call id, then the same rule at each fork), and the others are branches.
    ``terminal_call_id`` (the call whose response the verifier scored) overrides that choice, as in Gym:
    the main chain is the path from its root to that call, a retry group containing it is resolved to it,
    and ``notes.terminal_chain`` says whether it was delivered.

    That is the rule for snapshots without lineage. A snapshot whose records state their parents is built
    as Gym 0.7.0 builds it (same chains, tokens, notes): see ``_lineage_merging``.
    """
    listed = list(entries)
    if _has_lineage(listed):
        return _lineage_merging(listed, terminal_call_id)
    producing, empty = _split_empty_generations(listed)
    captured = sum(len(entry.generation_token_ids) for entry in producing)
    ordered = sorted(producing, key=lambda entry: (len(entry.prompt_token_ids), entry.model_call_id))
    nodes = _attach_to_parents(ordered)
    unresolved, discarded = _resolve_retries(nodes)
    terminal = next((node for node in nodes if node.entry.model_call_id == terminal_call_id), None)
    terminal_chain = ""
    if terminal_call_id is not None:
        terminal_chain = (
            "not_captured" if terminal is None else "broken" if terminal.quarantined else "delivered"
        )
    if terminal_chain == "delivered" and terminal is not None:
        # The harness kept the terminal: its path wins over any same-prompt sibling.
        node_on_path: _CallNode | None = terminal
        while node_on_path is not None:
            node_on_path.discarded = False
            node_on_path = node_on_path.parent
        unresolved = [group for group in unresolved if terminal_call_id not in group]
        discarded = [call_id for call_id in discarded if call_id != terminal_call_id]
    kept = [node for node in nodes if not node.quarantined and not node.discarded]
    has_kept_child = {id(node.parent) for node in kept if node.parent is not None}
    leaves = [node for node in kept if id(node) not in has_kept_child]
    chains = sorted((_chain_ending_at(leaf) for leaf in leaves), key=_chain_order_key)
    if terminal_chain == "delivered" and terminal is not None:
        main_path = _chain_ending_at(terminal)
        chains = [main_path, *(chain for chain in chains if chain.chain_id != main_path.chain_id)]
    roots = sum(1 for node in kept if node.parent is None)
    main = chains[0] if chains else None
    notes = BuildNotes(
        builder=PREFIX_MERGING,
        roots=roots,
        chains=len(chains),
        generated_tokens_captured=captured,
        generated_tokens_delivered=main.generated_token_count if main is not None else 0,
        unresolved_retries=tuple(unresolved),
        discarded_retries=tuple(discarded),
        empty_generation_calls=empty,
        terminal_call_id=terminal_call_id,
        terminal_chain=terminal_chain,
    )
    return BuildOutput(
        chains=tuple(chains),
        notes=notes,
        main_chain_id=main.chain_id if main is not None else None,
        branch_chain_ids=tuple(chain.chain_id for chain in chains[1:]),
        quarantined_call_ids=tuple(sorted(node.entry.model_call_id for node in nodes if node.quarantined)),
    )


def per_request(entries: Iterable[TokenEntry]) -> BuildOutput:
    """One single-link chain per call that generated tokens, ordered by creation; no main chain."""
    producing, empty = _split_empty_generations(entries)
    ordered = sorted(producing, key=_creation_key)
    chains = tuple(
        Chain(
            chain_id=entry.model_call_id,
            root_prompt_token_ids=tuple(entry.prompt_token_ids),
            links=(ChainLink(entry),),
        )
        for entry in ordered
    )
    generated = sum(len(entry.generation_token_ids) for entry in ordered)
    notes = BuildNotes(
        builder=PER_REQUEST,
        roots=len(chains),
        chains=len(chains),
        generated_tokens_captured=generated,
        generated_tokens_delivered=generated,
        empty_generation_calls=empty,
    )
    return BuildOutput(chains=chains, notes=notes)


BUILDERS: dict[str, Builder] = {PREFIX_MERGING: prefix_merging, PER_REQUEST: per_request}
"""Every builder by name."""


def run_builder(
    entries: Iterable[TokenEntry], builder: str = PREFIX_MERGING, terminal_call_id: str | None = None
) -> BuildOutput:
    """Build with the named builder; an unknown name raises ``UnknownBuilderError`` listing the known ones.

    ``terminal_call_id`` anchors the main chain of ``prefix_merging`` (Gym's signature).
    """
    if builder not in BUILDERS:
        raise UnknownBuilderError(f"unknown trajectory builder {builder!r}; choose one of {sorted(BUILDERS)}")
    if builder == PREFIX_MERGING:
        return prefix_merging(entries, terminal_call_id=terminal_call_id)
    return BUILDERS[builder](entries)


_PROJECTION_NAMES = (
    "assert_prefix_contiguity",
    "project_chain_to_output_items",
    "project_main_chain_response",
)


def __getattr__(name: str) -> Any:
    """Gym's ``builder`` also holds the response projection; tokcap keeps it in ``tokcap.response_items``.

    Served lazily: the response-items module imports this one.
    """
    if name in _PROJECTION_NAMES:
        from tokcap import response_items

        return getattr(response_items, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

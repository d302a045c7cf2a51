"""Terminal attribution: which captured call produced the response the verifier scored (Gym 0.7.0's rules).

A rollout's capture holds every call the model server served: auxiliary calls, abandoned retries, a
sub-agent's branch. The finished record holds one scored response. Joining the two names the chain to
deliver, so such a rollout is trained on its scored chain instead of being masked for having more than one.

Independent witnesses testify, and none outranks another:

- ``explicit``: the record names the kept call (``_ng_terminal_model_call_id``). If that call was not
  captured, this witness abstains.
- ``declared``: the harness reports the served response id it kept (``terminal_response_id``). If no
  single captured call (or several with identical tokens) served that id, nothing is attributed, and the
  consumer masks the rollout: it would otherwise deliver a chain the harness did not keep.
- ``response_id``: the scored response's ``id`` equals the served id of one captured call.
- content: the fingerprint of the response's model-written items equals one call's own-output
  fingerprint (``content_output``), its stamped cumulative fingerprint (``content_cumulative``), or the
  response's trailing model-written block matches one call's output.

Inside a witness, two candidates with different token sequences are an abstention, not a guess. The
witnesses that spoke must agree (or name calls with identical tokens); a contradiction attributes nothing
and is kept in ``reason``, since it points at a real defect. This never raises on malformed content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokcap.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, is_model_written
from tokcap.log.records import TokenEntry

__all__ = ["TerminalAttribution", "resolve_terminal"]


@dataclass(frozen=True)
class TerminalAttribution:
    """The attributed call (``None`` when no witness could name one), the naming witness, and the trail.

    ``reason`` lists, comma-separated, every abstention and disagreement (Gym's words), and on success
    which other witnesses corroborated; it is kept on success too, as evidence.
    """

    model_call_id: str | None
    method: str = ""
    reason: str = ""

    @property
    def attributed(self) -> bool:
        """Whether a call was attributed."""
        return self.model_call_id is not None


def _identity(entry: TokenEntry) -> tuple[Any, ...]:
    """What training would consume from this call: staged custody hashes, else digest and length, else tokens."""
    extra = entry.model_extra or {}
    if extra.get("staging_key") is not None:
        return ("custody", extra.get("cumulative_hash"), extra.get("chain_hash"), entry.cum_len)
    if entry.digest and entry.cum_len is not None:
        return ("digest", entry.digest, entry.cum_len)
    return ("tokens", tuple(entry.prompt_token_ids), tuple(entry.generation_token_ids))


def _one_sequence(candidates: Sequence[TokenEntry]) -> TokenEntry | None:
    """The candidate when all name one token sequence (smallest call id among equals), else ``None``."""
    if not candidates:
        return None
    if len({_identity(entry) for entry in candidates}) != 1:
        return None
    return min(candidates, key=lambda entry: entry.model_call_id)


def _fingerprint(items: Sequence[Any]) -> str | None:
    """The model-written fingerprint of items, or ``None`` when they cannot be fingerprinted."""
    try:
        return assistant_fingerprint(list(items))
    except (TypeError, ValueError):
        return None


def _content_witness(
    entries: Sequence[TokenEntry], response: Mapping[str, Any], reasons: list[str]
) -> tuple[str, TokenEntry] | None:
    """Match the scored response's model-written content to one call, pooling all three readings."""
    output = response.get("output")
    if not isinstance(output, list) or not output:
        reasons.append("response_has_no_output")
        return None
    items = [item for item in output if isinstance(item, Mapping)]
    target = _fingerprint(items)
    if target is None:
        reasons.append("response_output_unfingerprintable")
        return None
    if not target:
        reasons.append("no_model_authored_output")
        return None
    trailing: list[Mapping[str, Any]] = []
    for item in reversed(items):
        if not is_model_written(item):
            break
        trailing.append(item)
    trailing.reverse()
    tail = (_fingerprint(trailing) or "") if trailing and len(trailing) != len(items) else ""

    matches: dict[str, TokenEntry] = {}
    cumulative_hit = False
    custody_hit = False
    for entry in entries:
        extra = entry.model_extra or {}
        continuation = entry.continuation_fingerprint
        version = entry.fingerprint_version
        if extra.get("staging_key") is not None:
            if version != FINGERPRINT_VERSION:
                continue
            own_output = extra.get("output_fingerprint")
            if (continuation and continuation == target) or (
                own_output and (own_output == target or (tail and own_output == tail))
            ):
                matches[entry.model_call_id] = entry
                custody_hit = True
            continue
        if continuation and continuation == target and version in (None, FINGERPRINT_VERSION):
            matches[entry.model_call_id] = entry
            cumulative_hit = True
        if entry.output_items:
            own = _fingerprint(entry.output_items)
            if own and (own == target or (tail and own == tail)):
                matches[entry.model_call_id] = entry
    winner = _one_sequence(list(matches.values()))
    if winner is None:
        reasons.append("content_ambiguous" if matches else "no_content_match")
        return None
    if custody_hit:
        return ("content", winner)
    return ("content_cumulative" if cumulative_hit else "content_output", winner)


def resolve_terminal(
    entries: Sequence[TokenEntry],
    response: Mapping[str, Any] | None,
    explicit_call_id: str | None = None,
    *,
    declared_response_id: str | None = None,
) -> TerminalAttribution:
    """Join the scored ``response`` (``None`` when the record has none) to one captured call.

    ``explicit_call_id`` and ``declared_response_id`` are what the record says about the kept call.
    The witness order only decides which method names an agreeing verdict.
    """
    reasons: list[str] = []
    witnesses: list[tuple[str, TokenEntry]] = []
    by_call = {entry.model_call_id: entry for entry in entries}
    if explicit_call_id:
        named = by_call.get(explicit_call_id)
        if named is None:
            reasons.append("explicit_terminal_not_captured")
        else:
            witnesses.append(("explicit", named))
    if declared_response_id:
        declared = [entry for entry in entries if entry.response_id == declared_response_id]
        kept = _one_sequence(declared)
        if kept is None:
            reasons.append("declared_ambiguous" if declared else "declared_terminal_not_captured")
            return TerminalAttribution(None, reason=",".join(reasons))
        witnesses.append(("declared", kept))
    if isinstance(response, Mapping):
        response_id = str(response.get("id") or "")
        if not response_id:
            reasons.append("response_has_no_id")
        else:
            served = [entry for entry in entries if entry.response_id and entry.response_id == response_id]
            if not served:
                reasons.append("response_id_no_match")
            elif (winner := _one_sequence(served)) is None:
                reasons.append("response_id_ambiguous")
            else:
                witnesses.append(("response_id", winner))
        content = _content_witness(entries, response, reasons)
        if content is not None:
            witnesses.append(content)
    else:
        reasons.append("no_response_object")
    if not witnesses:
        return TerminalAttribution(None, reason=",".join(reasons))
    if _one_sequence([entry for _, entry in witnesses]) is None:
        detail = ";".join(f"{method}={entry.model_call_id}" for method, entry in witnesses)
        reasons.append(f"witness_disagreement[{detail}]")
        return TerminalAttribution(None, reason=",".join(reasons))
    method, named = witnesses[0]
    if len(witnesses) > 1:
        reasons.append("corroborated_by=" + "+".join(other for other, _ in witnesses[1:]))
    return TerminalAttribution(named.model_call_id, method=method, reason=",".join(reasons))

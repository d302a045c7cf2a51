"""The request-scoped capture path: who is calling, and where its tokens go.

Middleware opens a ``CaptureContext`` for one model call with ``set_token_sink``.
Before dispatch, ``resolve_parent`` decides once which recorded call the request continues (through the
context's lineage resolver, else the installed one), and ``register_call_intent`` records the call's
intent, so a call whose entry never arrives masks the rollout at freeze.
After generation, ``capture_tokens`` (response side) or ``commit_entry`` (engine side) stamps the
call's ``TokenEntry`` with that decision (``stamp_lineage``) and with its own lookup metadata
(``stamp_continuation``), as Gym's middleware does, and stores it; so lineage needs no Gym.
With ``CaptureContext(delta_records=True)`` a proven continuation is stored as its prompt suffix
(``tokcap.delta_records``), as Gym's ``delta_records`` does.

Failure chain:

- ``begin_call`` fails: the error propagates and the model call fails before generation; nothing is lost.
- ``put`` fails: the model call still succeeds and the rollout is marked incomplete.
- Marking fails too: an error naming the rollout is logged; the dangling intent masks the rollout at freeze.

Capture never raises into a model call after generation.
Untagged traffic has no context, and capture is then a no-op.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel

from tokcap.delta_records import store_as_delta
from tokcap.errors import TokenExtractionError
from tokcap.fingerprint import assistant_fingerprint
from tokcap.lineage import LineageResolution, stamp_continuation
from tokcap.log.records import (
    ParentResolutionStatus,
    TokenEntry,
    find_token_fields,
    response_items,
    stamp_lineage,
    strip_token_arrays,
)
from tokcap.protocols import (
    IntentTokenSink,
    LineageResolver,
    TokenSink,
    installed_lineage_store,
    installed_token_sink,
)

__all__ = [
    "CaptureContext",
    "cancel_call_intent",
    "capture_tokens",
    "commit_entry",
    "current_capture_context",
    "logger",
    "register_call_intent",
    "reset_token_sink",
    "resolve_parent",
    "set_token_sink",
    "stamp_continuation",
    "stamp_lineage",
    "token_entry_from_response",
]

logger = logging.getLogger(__name__)


@dataclass
class CaptureContext:
    """The identity of one model call and the sink its tokens go to.

    ``token_sink=None`` means another process stages the records and only the identity travels;
    the process-installed sink, if any, is used instead.
    ``committed`` turns true after the call's entry was stored, so a second capture is a no-op.
    ``lineage_store=None`` uses the process-installed resolver, if any.
    ``parent_resolution`` is the one decision ``resolve_parent`` made before dispatch; capture reuses it.
    ``request_items`` are the request as the harness sent it, kept by ``resolve_parent`` for stamping.
    ``delta_records`` (the config block's ``delta_records``) stores a RESOLVED continuation as the prompt
    suffix after its proven parent, when its prompt starts with exactly the parent's tokens.
    """

    rollout_id: str
    model_call_id: str
    token_sink: TokenSink | None
    model: str = ""
    committed: bool = False
    lineage_store: LineageResolver | None = None
    parent_resolution: LineageResolution | None = None
    request_items: list[Any] | None = None
    delta_records: bool = False

    @property
    def parent_call_id(self) -> str | None:
        """The proven parent's call id, once resolved."""
        match = self.parent_resolution.match if self.parent_resolution is not None else None
        return match.model_call_id if match is not None else None

    @property
    def parent_tokens(self) -> list[int]:
        """The proven parent's cumulative tokens (the prefix this call's prompt extends), else empty."""
        match = self.parent_resolution.match if self.parent_resolution is not None else None
        return list(match.cumulative_token_ids) if match is not None else []


_CURRENT_CONTEXT: ContextVar[CaptureContext | None] = ContextVar("tokcap_capture_context", default=None)


def set_token_sink(context: CaptureContext) -> Token[CaptureContext | None]:
    """Open a capture context for the current task; pass the token to ``reset_token_sink`` afterwards."""
    return _CURRENT_CONTEXT.set(context)


def reset_token_sink(token: Token[CaptureContext | None]) -> None:
    """Restore the context that was current before the matching ``set_token_sink``."""
    _CURRENT_CONTEXT.reset(token)


def current_capture_context() -> CaptureContext | None:
    """The capture context of the current task, or ``None`` for untagged traffic."""
    return _CURRENT_CONTEXT.get()


def _sink_for(context: CaptureContext) -> TokenSink | None:
    """A context's own sink wins over the process-installed sink."""
    return context.token_sink if context.token_sink is not None else installed_token_sink()


def _resolver_for(context: CaptureContext) -> LineageResolver | None:
    """A context's own resolver wins over the process-installed one."""
    return context.lineage_store if context.lineage_store is not None else installed_lineage_store()


async def resolve_parent(request_messages: list[Any] | None) -> None:
    """Decide, once and before dispatch, which recorded call this request continues.

    The decision lands on the context (``parent_resolution``): ROOT for a request with no model-written
    turn, else the resolver's answer; UNRESOLVED with reason ``resolver_unavailable`` when there is no
    resolver, or ``lookup_error`` when it failed (logged). Never raises: UNRESOLVED is always safe,
    because the builder masks what it cannot prove rather than train on a guessed prefix.
    Untagged traffic (no context) or no request is a no-op.
    """
    context = current_capture_context()
    if context is None or request_messages is None:
        return
    context.request_items = list(request_messages)
    try:
        resolver = _resolver_for(context)
        if not assistant_fingerprint(request_messages):
            context.parent_resolution = LineageResolution(ParentResolutionStatus.ROOT)
        elif resolver is None:
            context.parent_resolution = LineageResolution(
                ParentResolutionStatus.UNRESOLVED, reason="resolver_unavailable"
            )
        else:
            context.parent_resolution = await resolver.resolve(context.rollout_id, list(request_messages))
    except Exception:
        logger.warning(
            "could not resolve the parent of call %r of rollout %r; it is recorded as unresolved",
            context.model_call_id,
            context.rollout_id,
            exc_info=True,
        )
        context.parent_resolution = LineageResolution(
            ParentResolutionStatus.UNRESOLVED, reason="lookup_error"
        )


def _stamp(context: CaptureContext, entry: TokenEntry, resolution: LineageResolution | None) -> None:
    """Stamp the parent decision (``not_attempted`` when none was made) on the entry, as Gym's commit does.

    With ``delta_records`` a RESOLVED entry whose prompt extends its parent's exact tokens is cut to its
    suffix first; the digest and ``cum_len`` still describe the full sequence.
    """
    if resolution is None:
        resolution = LineageResolution(ParentResolutionStatus.UNRESOLVED, reason="not_attempted")
    match = resolution.match
    cumulative = None
    if context.delta_records and resolution.status == ParentResolutionStatus.RESOLVED and match is not None:
        cumulative = store_as_delta(entry, match.cumulative_token_ids)
    stamp_lineage(
        entry,
        match.model_call_id if match is not None else None,
        parent_resolution=ParentResolutionStatus(resolution.status.value),
        cumulative=cumulative,
    )
    entry.parent_resolution_reason = resolution.reason or ""


async def register_call_intent() -> None:
    """Record, before dispatch, that the current call is about to generate.

    A sink that is not an ``IntentTokenSink`` (no ``begin_call``), or no context, makes this a no-op.
    A failure propagates on purpose: the model call fails before generation and nothing is lost.
    """
    context = current_capture_context()
    if context is None:
        return
    sink = _sink_for(context)
    if sink is None:
        return
    if not isinstance(sink, IntentTokenSink):
        return
    await sink.begin_call(context.rollout_id, context.model_call_id)


async def cancel_call_intent() -> None:
    """Close the current call's intent when it ended without generation (for example, the request failed).

    A failure is logged, not raised: the dangling intent then masks the rollout at freeze, which is safe.
    """
    context = current_capture_context()
    if context is None or context.committed:
        return
    sink = _sink_for(context)
    if sink is None:
        return
    if not isinstance(sink, IntentTokenSink):
        return
    try:
        await sink.cancel_call(context.rollout_id, context.model_call_id)
    except Exception:
        logger.exception(
            "could not cancel the intent of call %r of rollout %r; the dangling intent will mask the rollout",
            context.model_call_id,
            context.rollout_id,
        )


def _response_as_mapping(response: Any) -> Mapping[str, Any]:
    """Accept a pydantic model or a mapping; anything else is unsupported."""
    if isinstance(response, BaseModel):
        return cast("Mapping[str, Any]", response.model_dump(mode="json"))
    if isinstance(response, Mapping):
        return response
    raise TokenExtractionError(
        f"cannot capture tokens from a {type(response).__name__}; pass the pydantic model or dict response"
    )


def token_entry_from_response(context: CaptureContext, response: Any) -> TokenEntry | None:
    """Build the call's ``TokenEntry`` from a model response; ``None`` when it carries no token ids.

    The content items are kept without their token arrays, and ``token_item_index`` records which kept item
    carried them.
    Raise ``TokenExtractionError`` for an unsupported response type or for partial or ambiguous
    token metadata, and a pydantic ``ValidationError`` (a ``ValueError``) when the arrays disagree.
    """
    payload = _response_as_mapping(response)
    fields = find_token_fields(payload)
    if fields is None:
        return None
    kept_items: list[dict[str, Any]] = []
    token_item_index: int | None = None
    for index, item in enumerate(response_items(payload) or []):
        if not isinstance(item, Mapping):
            continue
        if index == fields.item_index:
            token_item_index = len(kept_items)
        kept_items.append(strip_token_arrays(item))
    payload_model = payload.get("model")
    return TokenEntry(
        rollout_id=context.rollout_id,
        model_call_id=context.model_call_id,
        model=context.model or (payload_model if isinstance(payload_model, str) else ""),
        prompt_token_ids=fields.prompt_token_ids,
        generation_token_ids=fields.generation_token_ids,
        generation_log_probs=fields.generation_log_probs,
        routed_experts=fields.routed_experts,
        output_items=kept_items,
        token_item_index=token_item_index,
        # The served payload's own id, as Gym records it; never minted.
        response_id=str(payload.get("id") or "") or None,
        created_at=time.time(),
    )


async def _mark_call_lost(context: CaptureContext, sink: TokenSink, reason: str) -> None:
    """Durably mark the rollout incomplete; if that fails too, say loudly which rollout is at risk."""
    logger.error(
        "token capture lost call %r of rollout %r: %s; marking the rollout incomplete",
        context.model_call_id,
        context.rollout_id,
        reason,
    )
    mark_incomplete = getattr(sink, "mark_incomplete", None)
    if not callable(mark_incomplete):
        logger.error(
            "sink %s has no mark_incomplete: rollout %r lost call %r and nothing durable records it; "
            "only a dangling intent (if begin_call ran) will mask it",
            type(sink).__name__,
            context.rollout_id,
            context.model_call_id,
        )
        return
    try:
        await mark_incomplete(context.rollout_id, context.model_call_id)
    except Exception:
        logger.exception(
            "could not mark rollout %r incomplete after losing call %r; the dangling intent of that call "
            "must mask the rollout at freeze",
            context.rollout_id,
            context.model_call_id,
        )


async def _put_entry(
    context: CaptureContext, sink: TokenSink, entry: TokenEntry, resolution: LineageResolution | None
) -> bool:
    """Stamp and store the entry; on failure mark the rollout incomplete. Return whether it was stored."""
    try:
        _stamp(context, entry, resolution)
        await sink.put(entry)
    except Exception as exc:
        await _mark_call_lost(context, sink, f"put failed: {type(exc).__name__}: {exc}")
        return False
    context.committed = True
    return True


def _uncommitted_call() -> tuple[CaptureContext, TokenSink] | None:
    """The current call and its sink, unless there is no context, no sink, or the call is already stored."""
    context = current_capture_context()
    if context is None or context.committed:
        return None
    sink = _sink_for(context)
    return None if sink is None else (context, sink)


async def capture_tokens(response: Any, request_messages: list[Any] | None = None) -> TokenEntry | None:
    """Store the current call's tokens from its model response; return the stored entry, else ``None``.

    The entry gets the parent decision made before dispatch (resolved here if ``resolve_parent`` was
    skipped and ``request_messages`` is given) and the continuation stamp of its request
    (``request_messages``, else the request ``resolve_parent`` saw), so the next call can find it.
    A response with no token ids, an unsupported type or a build error marks the rollout incomplete.
    Nothing happens without a context, without a sink, or when the call was already committed.
    This never raises into the model call.
    """
    target = _uncommitted_call()
    if target is None:
        return None
    context, sink = target
    try:
        entry = token_entry_from_response(context, response)
    except Exception as exc:
        await _mark_call_lost(context, sink, f"could not build the entry: {type(exc).__name__}: {exc}")
        return None
    if entry is None:
        await _mark_call_lost(context, sink, "the response carries no token ids")
        return None
    if context.parent_resolution is None and request_messages is not None:
        await resolve_parent(request_messages)
    request = request_messages if request_messages is not None else context.request_items
    try:
        if request is not None:
            stamp_continuation(entry, list(request))
    except Exception as exc:
        await _mark_call_lost(context, sink, f"could not stamp the entry: {type(exc).__name__}: {exc}")
        return None
    return entry if await _put_entry(context, sink, entry, context.parent_resolution) else None


async def commit_entry(entry: TokenEntry, *, parent_resolution: LineageResolution | None = None) -> bool:
    """Store an entry built engine-side, which already has the arrays; return whether it was stored.

    The entry is stamped with ``parent_resolution``, else the context's pre-dispatch decision, else
    UNRESOLVED ``not_attempted``. As in Gym, a caller outside ``capture_tokens`` runs
    ``stamp_continuation`` itself; an entry without it cannot be found as a parent.

    An entry whose rollout id or call id differs from the context's marks the context's rollout incomplete.
    Nothing happens without a context, without a sink, or when the call was already committed.
    This never raises into the model call.
    """
    target = _uncommitted_call()
    if target is None:
        return False
    context, sink = target
    if (entry.rollout_id, entry.model_call_id) != (context.rollout_id, context.model_call_id):
        await _mark_call_lost(
            context,
            sink,
            f"the entry names rollout {entry.rollout_id!r} call {entry.model_call_id!r}, not the context's",
        )
        return False
    return await _put_entry(context, sink, entry, parent_resolution or context.parent_resolution)

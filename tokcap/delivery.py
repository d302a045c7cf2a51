"""Rebuild finished rollout records from their frozen snapshots, and retire what was consumed.

A rollout record is a plain dict, for example
``{"_ng_rollout_id": "r1", "reward": 1.0, "response": {"output": [...]}, ...}`` (Gym 0.7.0's keys).

Finding the rollout id: ``finalize_rollout_token_capture`` calls ``rollout_id_of(record)``, which defaults
to ``rollout_id_from_record`` (a non-empty string under Gym's ``_ng_rollout_id``, else under ``rollout_id``).
Pass another callable for records that keep the id elsewhere.

Masking: a record that must not be trained on gets top-level ``mask_sample: True``; the reasons are under
``record["_ng_token_capture"]["mask_reasons"]`` (Gym's key), next to the rest of the capture metrics.
The record's ``response`` is what the verifier scored: its ``id``, and Gym's ``_ng_terminal_model_call_id``
and ``terminal_response_id`` keys, name the terminal call that anchors the main chain.

Finalization never retires: the caller retires with ``retire_rollout_token_capture`` after the record's
durable hand-off, and only a build that ``capture_build_can_retire`` approves is dropped.
Masked or failed builds keep their capture evidence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from tokcap.consumer import (
    ROLLOUT_ID_KEY,
    MaskReason,
    TrajectoryResult,
    check_single_response_builder,
    rollout_id_from_record,
    trajectories_from_source,
)
from tokcap.errors import InvalidInputError
from tokcap.protocols import TokenSource

__all__ = [
    "MASK_SAMPLE_KEY",
    "ROLLOUT_ID_KEY",
    "TERMINAL_CALL_KEY",
    "TERMINAL_RESPONSE_ID_KEY",
    "TOKEN_CAPTURE_KEY",
    "TOKEN_CAPTURE_METRICS_KEY",
    "RolloutIdLocator",
    "capture_build_can_retire",
    "finalize_rollout_token_capture",
    "logger",
    "retire_rollout_token_capture",
    "rollout_carries_token_ids",
    "rollout_id_from_record",
]

logger = logging.getLogger(__name__)

MASK_SAMPLE_KEY = "mask_sample"
"""Top-level record key set to ``True`` when the record must not be trained on."""

TOKEN_CAPTURE_KEY = "_ng_token_capture"
"""Top-level record key holding the capture metrics, including ``mask_reasons`` (Gym's key)."""

TOKEN_CAPTURE_METRICS_KEY = TOKEN_CAPTURE_KEY
"""tokcap 0.1's name for ``TOKEN_CAPTURE_KEY``; the key itself is now Gym's."""

TERMINAL_CALL_KEY = "_ng_terminal_model_call_id"
"""Gym's record key naming the model call the harness kept as its final answer."""

TERMINAL_RESPONSE_ID_KEY = "terminal_response_id"
"""Gym's record key for the served response id the harness reports for the completion it kept."""

RolloutIdLocator = Callable[[Mapping[str, Any]], str | None]
"""Finds a record's rollout id; returns ``None`` when the record has none."""


def rollout_carries_token_ids(result: Mapping[str, Any]) -> bool:
    """Gym's name: whether the record's response already has generated token ids (then it is not rebuilt)."""
    return _carries_generated_tokens(result)


def _carries_generated_tokens(record: Mapping[str, Any]) -> bool:
    """Whether the record's response already has token ids, so rebuilding it would overwrite real data."""
    response = record.get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    if not isinstance(output, list):
        return False
    return any(isinstance(item, Mapping) and item.get("generation_token_ids") for item in output)


def _write_metrics(record: MutableMapping[str, Any], result: TrajectoryResult) -> None:
    existing = record.get(TOKEN_CAPTURE_METRICS_KEY)
    metrics = dict(existing) if isinstance(existing, Mapping) else {}
    metrics.update(result.metrics)
    metrics["masked"] = result.masked
    metrics["mask_reasons"] = list(result.mask_reasons)
    record[TOKEN_CAPTURE_METRICS_KEY] = metrics
    if result.masked:
        record[MASK_SAMPLE_KEY] = True


def _masked_result(
    rollout_id: str, reason: MaskReason, detail: str, base: TrajectoryResult | None = None
) -> TrajectoryResult:
    reasons = (*(base.mask_reasons if base is not None else ()), str(reason))
    metrics = dict(base.metrics) if base is not None else {}
    metrics["errors"] = [*metrics.get("errors", []), detail]
    metrics["masked"] = True
    metrics["mask_reasons"] = list(reasons)
    return TrajectoryResult(
        rollout_id=rollout_id,
        response=None,
        masked=True,
        mask_reasons=reasons,
        snapshot_id=base.snapshot_id if base is not None else None,
        version=base.version if base is not None else None,
        build=base.build if base is not None else None,
        metrics=metrics,
    )


async def _freeze_only(rollout_id: str, source: TokenSource) -> TrajectoryResult:
    """Freeze a rollout whose record already has its tokens, so its snapshot can still be retired."""
    try:
        snapshot = await source.freeze(rollout_id)
    except Exception as exc:
        logger.exception("could not freeze rollout %r whose record already carries tokens", rollout_id)
        return _masked_result(rollout_id, MaskReason.FREEZE_FAILED, f"{type(exc).__name__}: {exc}")
    return TrajectoryResult(
        rollout_id=rollout_id,
        response=None,
        masked=False,
        mask_reasons=(),
        snapshot_id=snapshot.snapshot_id,
        version=snapshot.version,
        metrics={
            "masked": False,
            "mask_reasons": [],
            "record_already_tokenized": True,
            "snapshot_id": snapshot.snapshot_id,
            "version": snapshot.version,
            "entries": len(snapshot.entries),
            "incomplete": snapshot.incomplete,
        },
    )


async def finalize_rollout_token_capture(
    result: MutableMapping[str, Any],
    source: TokenSource,
    *,
    rollout_id_of: RolloutIdLocator = rollout_id_from_record,
    builder: str = "prefix_merging",
    model: str = "",
) -> TrajectoryResult:
    """Rebuild ``result["response"]["output"]`` in place from the rollout's frozen snapshot.

    Reward and every other field are kept.
    On any failure the record is masked (``mask_sample``, reasons under ``_ng_token_capture``);
    this never raises for a malformed rollout or record.
    A record that already carries generated token ids is left unchanged, but its snapshot is frozen so it
    can be retired.
    The snapshot is never retired here; pass the returned result to ``retire_rollout_token_capture``
    after the record's durable hand-off.
    An unknown builder or ``per_request`` is a configuration error, not a record failure: it raises
    before the record is touched.
    """
    check_single_response_builder(builder)
    try:
        rollout_id = rollout_id_of(result)
    except Exception as exc:
        logger.exception("the rollout id locator failed on a record; masking it")
        rollout_id, locator_error = None, f"{type(exc).__name__}: {exc}"
    else:
        locator_error = "the record names no rollout id"
    if rollout_id is None:
        outcome = _masked_result("", MaskReason.NO_ROLLOUT_ID, locator_error)
        _write_metrics(result, outcome)
        return outcome
    if _carries_generated_tokens(result):
        outcome = await _freeze_only(rollout_id, source)
        _write_metrics(result, outcome)
        return outcome
    try:
        response = result.get("response")
        explicit = result.get(TERMINAL_CALL_KEY)
        declared = result.get(TERMINAL_RESPONSE_ID_KEY)
        # As in Gym: the scored response is the record's non-empty response object; its model names the
        # projection's model unless the caller gave one.
        scored = response if isinstance(response, Mapping) and response else None
        outcome = await trajectories_from_source(
            rollout_id,
            source,
            builder,
            model or str((scored or {}).get("model") or ""),
            verified_response=scored,
            explicit_terminal_call_id=str(explicit) if explicit else None,
            declared_response_id=str(declared) if declared else None,
        )
    except Exception as exc:
        logger.exception("finalizing rollout %r failed unexpectedly; masking it", rollout_id)
        outcome = _masked_result(rollout_id, MaskReason.BUILD_FAILED, f"{type(exc).__name__}: {exc}")
        _write_metrics(result, outcome)
        return outcome
    response = result.get("response")
    if outcome.response is not None:
        if isinstance(response, MutableMapping):
            response["output"] = outcome.response["output"]
        else:
            outcome = _masked_result(
                rollout_id, MaskReason.NO_RESPONSE, "the record has no response object to rebuild", outcome
            )
    _write_metrics(result, outcome)
    return outcome


def capture_build_can_retire(built: TrajectoryResult | None) -> bool:
    """Only an unmasked result that names its frozen snapshot may retire it; everything else keeps evidence."""
    if built is None:
        return False
    return not built.masked and built.snapshot_id is not None and built.version is not None


async def retire_rollout_token_capture(
    rollout_id: str, source: TokenSource, built: TrajectoryResult | None
) -> bool:
    """Drop exactly the snapshot ``built`` consumed, after the record's durable hand-off.

    Return ``False`` without touching the source when the build may not retire (masked, failed or none),
    and otherwise the source's verdict: ``False`` when the rollout changed since the freeze.
    Raise ``InvalidInputError`` when ``built`` belongs to another rollout.
    """
    if built is None:
        return False
    if built.rollout_id != rollout_id:
        raise InvalidInputError(
            f"cannot retire rollout {rollout_id!r} with the build of rollout {built.rollout_id!r}; "
            "pass the result finalize_rollout_token_capture returned for this record",
            rollout_id=rollout_id,
        )
    if not capture_build_can_retire(built) or built.snapshot_id is None or built.version is None:
        logger.info("keeping the capture evidence of rollout %r: %s", rollout_id, list(built.mask_reasons))
        return False
    dropped = await source.drop(rollout_id, built.snapshot_id, built.version)
    if not dropped:
        logger.warning(
            "rollout %r changed after snapshot %s version %s was consumed; its records are kept",
            rollout_id,
            built.snapshot_id,
            built.version,
        )
    return dropped

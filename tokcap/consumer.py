"""Freeze a finished rollout, build its trajectory and decide whether it may be trained on.

The decision is Gym 0.7.0's, in its order. Terminal attribution (``tokcap.terminal``) names the call whose
response the verifier scored; when the chain from its root to that call is intact it is delivered, and
auxiliary calls, sub-agents and discarded retries do not mask the rollout. A named terminal whose chain is
broken, or a declared response id that names no call, masks it. Without a terminal, any unresolved retry,
unproven parent link, second root or second chain masks it. An incomplete or empty snapshot, or a build
or projection that raises, always masks; nothing here raises for a malformed rollout. Every reason is a
``MaskReason``. The result carries the frozen ``snapshot_id`` and ``version``, so the caller retires
exactly what it consumed.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokcap.builder import BUILDERS, PER_REQUEST, BuildOutput, run_builder
from tokcap.config import token_id_capture_config
from tokcap.errors import MaskFractionExceededError, UndeliverableBuilderError, UnknownBuilderError
from tokcap.files.store import TokenCaptureStore
from tokcap.log.records import TokenEntry
from tokcap.protocols import TokenCaptureSnapshot, TokenSource
from tokcap.response_items import assert_prefix_contiguity, project_main_chain_response
from tokcap.terminal import TerminalAttribution, resolve_terminal

__all__ = [
    "ROLLOUT_ID_KEY",
    "MaskFractionGuard",
    "MaskReason",
    "TrajectoryResult",
    "check_single_response_builder",
    "clear_token_captures_for_rollouts",
    "logger",
    "rollout_id_from_record",
    "token_id_capture_dirs_from_config",
    "trajectories_for_rollout",
    "trajectories_from_source",
]

logger = logging.getLogger(__name__)

ROLLOUT_ID_KEY = "_ng_rollout_id"
"""Gym's top-level record key for the rollout id."""


class MaskReason(enum.StrEnum):
    """Why a rollout must not be trained on."""

    FREEZE_FAILED = "freeze-failed"
    INCOMPLETE = "incomplete"
    EMPTY = "empty"
    BUILD_FAILED = "build-failed"
    NO_MAIN_CHAIN = "no-main-chain"
    UNRESOLVED_RETRIES = "unresolved-retries"
    QUARANTINED_CALLS = "quarantined-calls"
    MULTIPLE_ROOTS = "multiple-roots"
    MULTIPLE_CHAINS = "multiple-chains"
    PROJECTION_FAILED = "projection-failed"
    TERMINAL_NOT_DELIVERED = "terminal-not-delivered"
    TERMINAL_NOT_ATTRIBUTED = "terminal-not-attributed"
    UNRESOLVED_PARENT = "unresolved-parent"
    MISSING_PARENT = "missing-parent"
    PARENT_DIGEST_MISMATCH = "parent-digest-mismatch"
    BROKEN_DELTA_CHAIN = "broken-delta-chain"
    DIGEST_MISMATCH = "digest-mismatch"
    CONFLICTING_DUPLICATE = "conflicting-duplicate"
    NO_ROLLOUT_ID = "no-rollout-id"
    NO_RESPONSE = "no-response"


@dataclass(frozen=True)
class TrajectoryResult(Mapping[str, Any]):
    """The trajectory of one rollout, or the reasons it is masked.

    ``response`` is the projected main chain, and ``None`` whenever the rollout is masked.
    ``snapshot_id`` and ``version`` name the frozen state consumed; ``None`` when the freeze failed.
    ``build`` is kept even for a masked rollout, as evidence.

    It also reads as the dict Gym 0.7.0's consumer returns (``rebuilt_response``, ``mask_sample``,
    ``metrics``, ``_capture_snapshot``, ``error``, ...), so code written against Gym, such as Gym's own
    ``retire_rollout_token_capture``, can use it unchanged.
    """

    rollout_id: str
    response: dict[str, Any] | None
    masked: bool
    mask_reasons: tuple[str, ...]
    snapshot_id: str | None
    version: int | None
    build: BuildOutput | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    def _gym_view(self) -> dict[str, Any]:
        view: dict[str, Any] = {
            "rollout_id": self.rollout_id,
            "builder": self.build.notes.builder if self.build is not None else "prefix_merging",
            "rebuilt_response": self.response,
            "metrics": self.metrics,
            "mask_sample": self.masked,
        }
        if self.build is not None:
            view["unresolved_retries"] = [
                call for group in self.build.notes.unresolved_retries for call in group
            ]
            view["unresolved_parent_calls"] = list(self.build.notes.unresolved_parent_calls)
        errors = self.metrics.get("errors")
        if errors:
            view["error"] = "; ".join(str(error) for error in errors)
        if self.snapshot_id is not None and self.version is not None:
            view["_capture_snapshot"] = {"snapshot_id": self.snapshot_id, "version": self.version}
        return view

    def __getitem__(self, key: str) -> Any:
        return self._gym_view()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._gym_view())

    def __len__(self) -> int:
        return len(self._gym_view())


_LINK_FAILURE_REASONS: dict[str, MaskReason] = {
    "parent_unresolved": MaskReason.UNRESOLVED_PARENT,
    "missing_resolution": MaskReason.UNRESOLVED_PARENT,
    "resolved_parent_missing_id": MaskReason.UNRESOLVED_PARENT,
    "parent_call_id_missing": MaskReason.MISSING_PARENT,
    "parent_digest_mismatch": MaskReason.PARENT_DIGEST_MISMATCH,
    "delta_chain_unreconstructable": MaskReason.BROKEN_DELTA_CHAIN,
    "digest_mismatch": MaskReason.DIGEST_MISMATCH,
    "duplicate_call_id_conflict": MaskReason.CONFLICTING_DUPLICATE,
}
"""Each builder note (Gym's names) of a parent link that could not be used, as a mask reason."""


def _reasons_from_build(
    build: BuildOutput, attribution: TerminalAttribution, declared_response_id: str | None
) -> list[MaskReason]:
    """Gym's order: a delivered terminal chain is trained on; a named but undeliverable one masks; else strict.

    Strict (no terminal named): any unresolved retry, unproven parent link, extra root or extra chain masks.
    """
    reasons: list[MaskReason] = []
    if build.main_chain is None:
        reasons.append(MaskReason.NO_MAIN_CHAIN)
    if build.notes.terminal_chain == "delivered":
        # The verified terminal's chain is intact; off-path calls are left out, not masked.
        return reasons
    if declared_response_id and not attribution.attributed:
        reasons.append(MaskReason.TERMINAL_NOT_ATTRIBUTED)
    if build.notes.terminal_chain:
        reasons.append(MaskReason.TERMINAL_NOT_DELIVERED)
    if build.notes.lineage and (attribution.attributed or declared_response_id):
        return reasons
    if build.notes.unresolved_retries:
        reasons.append(MaskReason.UNRESOLVED_RETRIES)
    for note in sorted(build.notes.parent_link_failures):
        reason = _LINK_FAILURE_REASONS.get(note)
        if reason is not None and reason not in reasons:
            reasons.append(reason)
    if build.quarantined_call_ids and not build.notes.lineage:
        reasons.append(MaskReason.QUARANTINED_CALLS)
    if build.notes.roots > 1:
        reasons.append(MaskReason.MULTIPLE_ROOTS)
    if build.notes.chains > 1:
        reasons.append(MaskReason.MULTIPLE_CHAINS)
    return reasons


def _metrics(
    snapshot: TokenCaptureSnapshot | None,
    build: BuildOutput | None,
    reasons: list[str],
    errors: list[str],
    attribution: TerminalAttribution,
) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "masked": bool(reasons),
        "mask_reasons": list(reasons),
        "snapshot_id": snapshot.snapshot_id if snapshot is not None else None,
        "version": snapshot.version if snapshot is not None else None,
        "entries": len(snapshot.entries) if snapshot is not None else 0,
        "incomplete": snapshot.incomplete if snapshot is not None else None,
    }
    if build is not None:
        metrics.update(build.notes.to_dict())
        metrics["quarantined_calls"] = list(build.quarantined_call_ids)
        metrics["main_chain_id"] = build.main_chain_id
        metrics["branch_chain_ids"] = list(build.branch_chain_ids)
    metrics["terminal_attribution"] = {
        "method": attribution.method or "none",
        "call_id": attribution.model_call_id,
        "reason": attribution.reason,
        # Gym's words: the builder's terminal verdict, else "error" when nothing could be delivered.
        "chain": (build.notes.terminal_chain if build is not None else "")
        or ("error" if build is None or build.main_chain is None or errors else ""),
    }
    if errors:
        metrics["errors"] = list(errors)
    return metrics


def check_single_response_builder(builder: str) -> None:
    """Refuse a builder that cannot feed one response per rollout, before anything is frozen."""
    if builder not in BUILDERS:
        raise UnknownBuilderError(f"unknown trajectory builder {builder!r}; choose one of {sorted(BUILDERS)}")
    if builder == PER_REQUEST:
        raise UndeliverableBuilderError(
            f"builder {builder!r} yields one chain per call and cannot deliver one response per rollout; "
            "use 'prefix_merging'"
        )


def _attribute(
    entries: tuple[TokenEntry, ...],
    verified_response: Mapping[str, Any] | None,
    explicit_terminal_call_id: str | None,
    declared_response_id: str | None,
) -> TerminalAttribution:
    """Terminal attribution that never fails a build: an error is logged and attributes nothing."""
    try:
        return resolve_terminal(
            entries, verified_response, explicit_terminal_call_id, declared_response_id=declared_response_id
        )
    except Exception:
        logger.warning("terminal attribution failed; building without a terminal", exc_info=True)
        return TerminalAttribution(None, reason="attribution_error")


async def trajectories_from_source(
    rollout_id: str,
    source: TokenSource,
    builder: str = "prefix_merging",
    model: str = "",
    *,
    verified_response: Mapping[str, Any] | None = None,
    explicit_terminal_call_id: str | None = None,
    declared_response_id: str | None = None,
) -> TrajectoryResult:
    """Freeze the rollout through ``source``, build, project and check the main chain.

    A malformed rollout is masked with its reasons in the result and its metrics; it never raises.
    An unknown builder or ``per_request`` raises before the freeze: that is a configuration error.
    The keyword arguments are Gym's: they name the terminal call (the one whose response was scored),
    which anchors the main chain; without one, every retry and extra chain masks the rollout.
    """
    check_single_response_builder(builder)
    try:
        snapshot: TokenCaptureSnapshot | None = await source.freeze(rollout_id)
        freeze_error: Exception | None = None
    except Exception as exc:
        logger.exception("could not freeze rollout %r; masking it", rollout_id)
        snapshot, freeze_error = None, exc
    attribution = _attribute(
        snapshot.entries if snapshot is not None else (),
        verified_response,
        explicit_terminal_call_id,
        declared_response_id,
    )
    return _trajectory(rollout_id, snapshot, freeze_error, builder, model, attribution, declared_response_id)


def _trajectory(
    rollout_id: str,
    snapshot: TokenCaptureSnapshot | None,
    freeze_error: Exception | None,
    builder: str,
    model: str,
    attribution: TerminalAttribution,
    declared_response_id: str | None,
) -> TrajectoryResult:
    """Build, project and check a frozen snapshot (``None`` when the freeze failed with ``freeze_error``)."""
    reasons: list[str] = []
    errors: list[str] = []
    if snapshot is None:
        reasons.append(MaskReason.FREEZE_FAILED)
        errors.append(f"{type(freeze_error).__name__}: {freeze_error}")
    build: BuildOutput | None = None
    response: dict[str, Any] | None = None
    if snapshot is not None:
        if snapshot.incomplete:
            reasons.append(MaskReason.INCOMPLETE)
        if not snapshot.entries:
            reasons.append(MaskReason.EMPTY)
        else:
            try:
                build = run_builder(snapshot.entries, builder, terminal_call_id=attribution.model_call_id)
                reasons.extend(_reasons_from_build(build, attribution, declared_response_id))
                main = build.main_chain
                if main is not None:
                    main.validate()
            except Exception as exc:
                logger.exception("building rollout %r failed; masking it", rollout_id)
                reasons.append(MaskReason.BUILD_FAILED)
                errors.append(f"{type(exc).__name__}: {exc}")
            if build is not None and build.main_chain is not None and MaskReason.BUILD_FAILED not in reasons:
                try:
                    response = project_main_chain_response(rollout_id, build, model)
                    assert_prefix_contiguity(response)
                except Exception as exc:
                    logger.exception("projecting rollout %r failed; masking it", rollout_id)
                    reasons.append(MaskReason.PROJECTION_FAILED)
                    errors.append(f"{type(exc).__name__}: {exc}")
                    response = None
    masked = bool(reasons)
    if masked:
        logger.warning("rollout %r is masked: %s", rollout_id, ", ".join(reasons))
    return TrajectoryResult(
        rollout_id=rollout_id,
        response=None if masked else response,
        masked=masked,
        mask_reasons=tuple(str(reason) for reason in reasons),
        snapshot_id=snapshot.snapshot_id if snapshot is not None else None,
        version=snapshot.version if snapshot is not None else None,
        build=build,
        metrics=_metrics(snapshot, build, [str(reason) for reason in reasons], errors, attribution),
    )


def rollout_id_from_record(record: Mapping[str, Any]) -> str | None:
    """A record's rollout id: a non-empty string under Gym's ``_ng_rollout_id``, else under ``rollout_id``."""
    for key in (ROLLOUT_ID_KEY, "rollout_id"):
        value = record.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def token_id_capture_dirs_from_config(global_config_dict: Any) -> list[Path]:
    """Gym's helper: the file-store directory to read, or none when capture is off or a sink owns the records."""
    config = token_id_capture_config(global_config_dict)
    directory = config.resolved_dir()
    if not config.enabled or config.token_id_capture.sink is not None or directory is None:
        return []
    return [directory]


def clear_token_captures_for_rollouts(
    records: Sequence[Mapping[str, Any]], token_capture_dirs: Sequence[str | Path]
) -> None:
    """Gym's helper: delete the records of rollouts about to be dispatched, so a reused id starts empty.

    Pass only records ready for dispatch, with any retry suffix already in their rollout id.
    """
    rollout_ids = sorted({rid for rid in (rollout_id_from_record(record) for record in records) if rid})
    for directory in token_capture_dirs:
        TokenCaptureStore(directory).delete_now(rollout_ids)


def trajectories_for_rollout(
    rollout_id: str,
    token_capture_dirs: Sequence[str | Path],
    *,
    builder: str = "prefix_merging",
    model: str = "",
    verified_response: Mapping[str, Any] | None = None,
    explicit_terminal_call_id: str | None = None,
) -> TrajectoryResult | None:
    """Gym's helper: ``trajectories_from_source`` over the first file-store directory, synchronously.

    Return ``None`` when no directory is configured.
    """
    if not token_capture_dirs:
        return None
    check_single_response_builder(builder)
    store = TokenCaptureStore(token_capture_dirs[0])
    try:
        snapshot: TokenCaptureSnapshot | None = store.freeze_now(rollout_id)
        freeze_error: Exception | None = None
    except Exception as exc:
        logger.exception("could not freeze rollout %r; masking it", rollout_id)
        snapshot, freeze_error = None, exc
    attribution = _attribute(
        snapshot.entries if snapshot is not None else (), verified_response, explicit_terminal_call_id, None
    )
    return _trajectory(rollout_id, snapshot, freeze_error, builder, model, attribution, None)


class MaskFractionGuard:
    """Stops training when too many rollouts are masked, since training on the rest would be biased.

    Configured from ``token_id_capture.max_mask_fraction`` (``None`` disables it) and
    ``token_id_capture.mask_fraction_min_samples`` (how many rollouts must be finalized before it judges).
    """

    def __init__(self, max_mask_fraction: float | None, min_samples: int = 50) -> None:
        self.max_mask_fraction = max_mask_fraction
        self.min_samples = min_samples
        self.finalized = 0
        self.masked = 0

    @property
    def masked_fraction(self) -> float:
        """Masked rollouts over finalized rollouts; 0.0 before any was finalized."""
        return self.masked / self.finalized if self.finalized else 0.0

    def record(self, result: TrajectoryResult | bool) -> None:
        """Count one finalized rollout (a result, or whether it was masked) and raise if the limit is passed.

        Raise ``MaskFractionExceededError`` naming the fraction, the limit and the setting.
        """
        masked = result if isinstance(result, bool) else result.masked
        self.finalized += 1
        self.masked += int(masked)
        limit = self.max_mask_fraction
        if limit is None or self.finalized < self.min_samples:
            return
        if self.masked_fraction > limit:
            raise MaskFractionExceededError(
                f"{self.masked} of {self.finalized} finalized rollouts were masked (fraction "
                f"{self.masked_fraction:.4f}), above token_id_capture.max_mask_fraction={limit} "
                f"(judged after token_id_capture.mask_fraction_min_samples={self.min_samples}); "
                "look at the mask reasons in the capture metrics, or raise the limit if this is expected"
            )

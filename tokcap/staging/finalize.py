"""From a rollout's manifest to one training row, or a masked placeholder: the trainer's last step.

``receipt_from_manifest`` does what Gym leaves to the framework: a manifest with any failure row gives a
poisoned receipt; otherwise the terminal call is the one row whose ``response_id`` is the response the
agent kept, or, without one, the parent-link walk (``tokcap.staging.terminal``). ``finalize_rollout``
fetches one snapshot per manifest row (abandoned branches included, as the verifier needs) and verifies
them; anything that fails (a poisoned receipt, a missing or damaged row, a broken chain) masks the
rollout with its reason, and nothing unverified is ever returned as a row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tokcap.errors import StagingKeyNotFoundError, StoreCorruptionError
from tokcap.staging.records import RolloutManifest, RolloutReceipt
from tokcap.staging.terminal import select_terminal_call
from tokcap.staging.verify import LinearizedRow, verify_and_linearize

__all__ = ["FinalizedRollout", "StagedRowFetcher", "finalize_rollout", "receipt_from_manifest"]


class StagedRowFetcher(Protocol):
    """Anything with Gym's ``StagingSource.fetch``."""

    def fetch(self, staging_keys: list[str]) -> list[Any]: ...


@dataclass(frozen=True)
class FinalizedRollout:
    """One rollout's outcome: a verified ``row``, or ``None`` and the reason it is masked."""

    rollout_id: str
    row: LinearizedRow | None
    masked_reason: str | None = None

    @property
    def masked(self) -> bool:
        """Whether the rollout must be left out of training (a placeholder with zero loss weight)."""
        return self.row is None


def _manifest(manifest: Mapping[str, Any] | Any) -> RolloutManifest:
    data = manifest.model_dump(mode="json") if hasattr(manifest, "model_dump") else manifest
    return RolloutManifest.model_validate(data)


def receipt_from_manifest(
    manifest: Mapping[str, Any] | Any, *, response_id: str | None = None, reward: float | None = None
) -> RolloutReceipt:
    """The receipt of a rollout: poisoned by any failure row, else naming its terminal call and how."""
    checked = _manifest(manifest)
    base: dict[str, Any] = {"rollout_id": checked.rollout_id, "reward": reward, "manifest": checked.records}
    if checked.failures:
        first = checked.failures[0]
        reason = f"{first.reason} (call {first.model_call_id})"
        return RolloutReceipt(**base, capture_poisoned=True, failure_reason=reason)
    if response_id is not None:
        named = [record for record in checked.records if record.response_id == response_id]
        if len(named) == 1:
            return RolloutReceipt(
                **base, terminal_model_call_id=named[0].model_call_id, terminal_selection="response_id"
            )
        reason = f"response id {response_id!r} names {len(named)} manifest rows, not one"
        return RolloutReceipt(**base, capture_poisoned=True, failure_reason=reason)
    selection = select_terminal_call(checked.records)
    if selection.terminal_model_call_id is None:
        return RolloutReceipt(
            **base, capture_poisoned=True, failure_reason=selection.reason, terminal_selection="heuristic"
        )
    return RolloutReceipt(
        **base, terminal_model_call_id=selection.terminal_model_call_id, terminal_selection="heuristic"
    )


def finalize_rollout(
    manifest: Mapping[str, Any] | Any,
    source: StagedRowFetcher,
    *,
    response_id: str | None = None,
    reward: float | None = None,
) -> FinalizedRollout:
    """One verified training row for the rollout, or a masked placeholder saying why."""
    receipt = receipt_from_manifest(manifest, response_id=response_id, reward=reward)
    if receipt.capture_poisoned:
        return FinalizedRollout(receipt.rollout_id, None, receipt.failure_reason or "capture_poisoned")
    try:
        snapshots = source.fetch([record.staging_key for record in receipt.manifest])
        return FinalizedRollout(receipt.rollout_id, verify_and_linearize(receipt, snapshots))
    except (ValueError, StagingKeyNotFoundError, StoreCorruptionError) as exc:
        return FinalizedRollout(receipt.rollout_id, None, str(exc))

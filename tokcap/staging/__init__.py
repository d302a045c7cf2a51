"""Engine-side staging (Gym's ``external_staging``) on tokcap's file store.

An inference worker stages each call's token delta through ``FileStagingSink``; Gym's model server
records a token-free ledger row through ``tokcap.lineage:FileLineageResolver`` (its ``CaptureLedger``);
the trainer reads the manifest, fetches the rows through ``FileStagingSource`` and verifies them with
``verify_and_linearize`` (tokcap's, equal to Gym's, or Gym's own). ``JournaledStagingSink`` puts a tokcap
sink as a journal behind a trainer's own staging store, and ``restage`` refills that store after a restore.
"""

from __future__ import annotations

from tokcap.staging.file_sink import FileStagingSink
from tokcap.staging.file_source import FileStagingSource
from tokcap.staging.finalize import FinalizedRollout, finalize_rollout, receipt_from_manifest
from tokcap.staging.journal import (
    JournalCursor,
    JournaledStagingSink,
    RestageRefusal,
    RestageReport,
    StagedRollout,
    cursors_taken,
    restage,
    staged_rollouts,
)
from tokcap.staging.verify import LinearizedRow, verify_and_linearize

__all__ = [
    "FileStagingSink",
    "FileStagingSource",
    "FinalizedRollout",
    "JournalCursor",
    "JournaledStagingSink",
    "LinearizedRow",
    "RestageRefusal",
    "RestageReport",
    "StagedRollout",
    "cursors_taken",
    "finalize_rollout",
    "receipt_from_manifest",
    "restage",
    "staged_rollouts",
    "verify_and_linearize",
]

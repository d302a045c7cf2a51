"""What a trainer is given for a rollout staged on the file transport: a mask, or the rollout's tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tokcap.errors import StoreCorruptionError
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSource, finalize_rollout

__all__ = ["finalized"]


def finalized(root: Path, rollout_id: str) -> tuple[bool, list[int] | None]:
    """Whether the rollout is masked and, if delivered, its tokens; a read that refuses the files masks too."""
    try:
        manifest = asyncio.run(FileLineageResolver(root).manifest(rollout_id))
    except (StoreCorruptionError, ValueError):
        return True, None
    done = finalize_rollout(manifest, FileStagingSource(root))
    return done.masked, None if done.row is None else list(done.row.token_ids)

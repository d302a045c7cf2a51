"""One trial of the load against the file store: the store is both sink and source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.load import LoadResult, PreparedWorkload, drive
from tokcap.files.store import TokenCaptureStore

__all__ = ["FileStoreTrial", "directory_bytes", "run_file_store_trial"]


def directory_bytes(directory: Path, pattern: str = "*") -> int:
    """Bytes of the regular files in a directory whose names match ``pattern``."""
    return sum(path.stat().st_size for path in directory.glob(pattern) if path.is_file())


@dataclass(frozen=True)
class FileStoreTrial:
    """The load's figures plus what the store did to make them durable."""

    load: LoadResult
    syncs: int
    disk_bytes: int
    entry_file_bytes: int

    @property
    def puts_per_sync(self) -> float:
        """How many puts shared one filesystem sync on average."""
        return self.load.puts / self.syncs if self.syncs else float("inf")


async def run_file_store_trial(workload: PreparedWorkload, directory: Path) -> FileStoreTrial:
    """Drive the load into a fresh store directory and read its sync counter afterwards."""
    store = TokenCaptureStore(directory)
    try:
        load = await drive(workload, store)
    finally:
        await store.close()
    return FileStoreTrial(
        load=load,
        syncs=store.commit_stats["syncs"],
        disk_bytes=directory_bytes(directory),
        entry_file_bytes=directory_bytes(directory, "*.tokens.jsonl"),
    )

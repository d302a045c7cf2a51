"""One materializer per directory and topic in a process, shared by every source on that directory.

Applying one partition into one directory twice would corrupt it, so a directory has one owner. Sources in
the owning process share its materializer; it stops when the last of them closes. A source in another
process follows the owner's checkpoint instead, and takes ownership over when the owner has gone.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokcap.errors import ConfigError
from transports.kafka.errors import MaterializerOwnedElsewhereError
from transports.kafka.materializer.loop import Materializer

__all__ = ["SharedMaterializers", "shared_materializers"]


@dataclass
class _Shared:
    materializer: Materializer
    users: int


class SharedMaterializers:
    """A process-wide registry: ``acquire`` gives the directory's materializer, ``release`` hands it back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_directory: dict[tuple[str, str], _Shared] = {}

    def acquire(
        self,
        bootstrap_servers: str,
        topic: str,
        store_dir: str | Path,
        consumer_config: Mapping[str, Any] | None = None,
        skipped_types: frozenset[str] = frozenset(),
    ) -> Materializer | None:
        """This process's materializer of the directory, started if need be; ``None`` if another process owns it.

        ``skipped_types`` must be what the directory's materializer skips (``Materializer``): a partial
        projection answers nobody who needs what it skipped.
        """
        key = (str(Path(store_dir).resolve()), topic)
        with self._lock:
            shared = self._by_directory.get(key)
            if shared is not None:
                if shared.materializer.skipped_types != skipped_types:
                    raise ConfigError(
                        f"{store_dir} is materialized in this process skipping "
                        f"{sorted(shared.materializer.skipped_types) or 'nothing'}, not "
                        f"{sorted(skipped_types) or 'nothing'}; give each kind of reader a directory of its own"
                    )
                shared.users += 1
                return shared.materializer
            materializer = Materializer(
                bootstrap_servers,
                topic,
                store_dir,
                consumer_config=consumer_config,
                skipped_types=skipped_types,
            )
            try:
                materializer.start()
            except MaterializerOwnedElsewhereError:
                materializer.stop()
                return None
            self._by_directory[key] = _Shared(materializer, 1)
            return materializer

    def release(self, materializer: Materializer) -> None:
        """Hand a materializer back; the last user stops it, which writes its checkpoint and frees the directory."""
        with self._lock:
            for key, shared in self._by_directory.items():
                if shared.materializer is materializer:
                    shared.users -= 1
                    if shared.users == 0:
                        del self._by_directory[key]
                        break
                    return
            else:
                return
        materializer.stop()


shared_materializers = SharedMaterializers()
"""The registry every ``KafkaTokenSource`` of this process uses."""

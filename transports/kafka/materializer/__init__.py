"""The materializer: one process per partition reads the run topic and projects it into the store.

``loop`` drives it; ``schedule``, ``apply``, ``waiters``, ``checkpoint``, ``ownership``, ``incarnation``,
``dead_letters``, ``workers`` and the rest are its parts. The loop's public names load on first use, so
``tokcap inspect`` can read checkpoints and dead letters without the ``kafka`` extra installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transports.kafka.materializer.loop import (
        CHECKPOINT_PREFIX,
        DEAD_LETTER_PREFIX,
        DEFAULT_SETTINGS,
        MATERIALIZER_WRITER,
        ORPHAN_AFTER_OFFSETS,
        DeadLetterLog,
        Materializer,
        MaterializerCounters,
        MaterializerSettings,
        PartitionCheckpoint,
        carry_out,
        logger,
        remove_stale_temp_files,
    )

__all__ = [
    "CHECKPOINT_PREFIX",
    "DEAD_LETTER_PREFIX",
    "DEFAULT_SETTINGS",
    "MATERIALIZER_WRITER",
    "ORPHAN_AFTER_OFFSETS",
    "DeadLetterLog",
    "Materializer",
    "MaterializerCounters",
    "MaterializerSettings",
    "PartitionCheckpoint",
    "carry_out",
    "logger",
    "remove_stale_temp_files",
]


def __getattr__(name: str) -> Any:
    """Import the loop the first time one of its public names is asked for."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.loop"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

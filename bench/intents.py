"""Intent and cancel pairs on one rollout: the work per event stays constant as the rollout grows.

    python -m bench --only intents

Per size (1,000, 2,000 and 4,000 pairs), the seconds to apply the pairs as a projection does (log positions,
a projection flushed every 200 events) and through the file store's own durable calls, the two taking turns, with
the time per 1,000 pairs, so a quadratic cost shows as a figure that grows with the size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.harness import Variant, alternate
from tokcap.files.log_projection import Projection
from tokcap.files.store import TokenCaptureStore
from tokcap.log.events import CancelEvent, IntentEvent, LogPosition

__all__ = ["measure_intents"]

_BLOCK = 200


def _projected(root: Path, pairs: int) -> float:
    projection = Projection(TokenCaptureStore(root))
    events = []
    for n in range(pairs):
        events.append(IntentEvent(rollout_id="r", model_call_id=f"c{n}"))
        events.append(CancelEvent(rollout_id="r", model_call_id=f"c{n}"))
    start = time.perf_counter()
    for first in range(0, len(events), _BLOCK):
        for offset in range(first, min(first + _BLOCK, len(events))):
            projection.apply(events[offset], LogPosition("bench", 0, offset))
        projection.flush()
    return time.perf_counter() - start


def _direct(root: Path, pairs: int) -> float:
    store = TokenCaptureStore(root)
    start = time.perf_counter()
    for n in range(pairs):
        store.begin_call_now("r", f"c{n}")
        store.cancel_call_now("r", f"c{n}")
    return time.perf_counter() - start


async def measure_intents(sizes: Sequence[int], trials: int, parent: Path) -> dict[str, Any]:
    """Per size, seconds for the pairs and per 1,000 pairs, projected and durable taking turns; medians."""
    figures: dict[str, Any] = {}
    for pairs in sizes:

        def variant(apply: Callable[[Path, int], float], count: int = pairs) -> Variant:
            async def trial(directory: Path) -> dict[str, float]:
                seconds = apply(directory, count)
                return {"seconds": seconds, "ms_per_1k": seconds / count * 1e6}

            return trial

        measured = await alternate(
            {"projected": variant(_projected), "durable": variant(_direct)}, trials, parent
        )
        figures[str(pairs)] = measured.summary()
    return figures

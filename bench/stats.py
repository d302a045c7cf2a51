"""Summaries of repeated measurements: medians and latency percentiles."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["median", "percentile"]


def median(values: Sequence[float]) -> float:
    """The median of repeated runs; NaN when nothing was measured."""
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (``fraction`` in 0..1) of latencies; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]

"""The goals the benchmarks are read against, as data: which figure, compared how, to what threshold, against what.

Each target names a figure of a run's results by its path (``main.figures.kafka_freeze_p99_ms``), a
comparator and a threshold, and the anchor a ratio divides by: Gym 0.7.0's own store on the same entries, the
raw floor of the same work (the disk or the producer with nothing around it), or straw-queue, the peer written
for the same job. Changing a goal is an edit of this table, never of benchmark code.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ANCHORS", "TARGETS", "Target", "evaluate", "lookup"]

ANCHORS = {
    "gym": "Gym 0.7.0's TokenCaptureStore, same entries, same load, same run",
    "floor": "the raw floor of the same work (disk write + fsync, orjson encode + write, or the raw producer)",
    "straw": "straw-queue 0.1.6's SharedFilesystemStore.publish of the same bytes (`--straw DIR`)",
    "self": "the same figure of another variant of the same scenario",
}
"""What a ratio target divides by."""

_COMPARE: Mapping[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">=": operator.ge,
    ">": operator.gt,
}


@dataclass(frozen=True)
class Target:
    """One goal: the figure at ``path`` of a run's results must stand ``comparator threshold``."""

    figure: str
    path: str
    comparator: str
    threshold: float
    anchor: str | None = None
    """A key of ``ANCHORS`` when the figure is a ratio; ``None`` for an absolute figure."""

    @property
    def scenario(self) -> str:
        """The scenario that measures the figure (the path's first part; the growth grid's corners are growth's)."""
        head = self.path.split(".", 1)[0]
        return "growth" if head == "growth_corners" else head

    @property
    def goal(self) -> str:
        """The goal as the tables show it, e.g. ``>= 5``."""
        return f"{self.comparator} {self.threshold:g}"

    def met(self, value: float) -> bool:
        """Whether a measured value meets the goal."""
        return _COMPARE[self.comparator](value, self.threshold)


TARGETS: tuple[Target, ...] = (
    Target(
        "Kafka freeze p99 under the main load, materializer in process (ms)",
        "main.figures.kafka_freeze_p99_ms",
        "<",
        50,
    ),
    Target(
        "Kafka freeze p99 under the main load, materializer in its own process (ms)",
        "main.figures.kafka_ext_freeze_p99_ms",
        "<",
        100,
    ),
    Target("file-store freeze p99 under the main load (ms)", "main.figures.file_freeze_p99_ms", "<", 10),
    Target("apply step CPU per event, materializer (us)", "main.figures.apply_cpu_us_per_event", "<=", 75),
    Target("CPU per file-store put (us)", "main.figures.file_put_cpu_us", "<=", 200),
    Target(
        "replay entries/s ÷ orjson encode + write", "main.figures.ratios.replay_vs_orjson", ">=", 0.5, "floor"
    ),
    Target(
        "  same, one worker process per partition",
        "main.figures.ratios.replay_workers_vs_orjson",
        ">=",
        0.5,
        "floor",
    ),
    Target("file-store put/s ÷ Gym, main load", "main.figures.ratios.file_puts_vs_gym", ">=", 5, "gym"),
    Target("file-store put/s ÷ Gym, batch run", "batch.targets.file.puts_vs_gym", ">=", 5, "gym"),
    Target("Kafka put/s ÷ Gym, main load", "main.figures.ratios.kafka_puts_vs_gym", ">=", 4, "gym"),
    Target("Kafka put/s ÷ Gym, batch run", "batch.targets.kafka.puts_vs_gym", ">=", 4, "gym"),
    Target(
        "Kafka freezes/s, batch frozen at once, ÷ Gym", "batch.targets.kafka.freezes_vs_gym", ">=", 2, "gym"
    ),
    Target("materializer apply, 2 workers ÷ 1 (events/s)", "workers.figures.2.vs_first", ">=", 1.7, "self"),
    Target(
        "wire B/call ÷ new tokens packed, largest shape (wire deltas on)",
        "growth_corners.largest.wire_vs_new_tokens_wire_on",
        "<=",
        1.25,
        "floor",
    ),
    Target(
        "  same ratio, most ÷ fewest turns at the largest prompt (flat)",
        "growth_corners.largest_vs_fewest_turns.wire_vs_new_tokens_wire_on",
        "<=",
        1.1,
        "self",
    ),
    Target(
        "store B/call ÷ JSON of new tokens, largest shape (delta records on)",
        "growth_corners.largest.store_vs_new_tokens_json_records_on",
        "<=",
        1.25,
        "floor",
    ),
    Target(
        "  same ratio, most ÷ fewest turns at the largest prompt (flat)",
        "growth_corners.largest_vs_fewest_turns.store_vs_new_tokens_json_records_on",
        "<=",
        1.1,
        "self",
    ),
    Target(
        "file-store put/s, largest ÷ smallest shape (delta records on)",
        "growth_corners.largest_vs_smallest.file_puts_per_s_records_on",
        ">=",
        0.5,
        "self",
    ),
    Target(
        "Kafka put/s, largest ÷ smallest shape (delta records on)",
        "growth_corners.largest_vs_smallest.kafka_puts_per_s_records_on",
        ">=",
        0.5,
        "self",
    ),
    Target(
        "Kafka freeze p99 at the largest shape (ms, delta records on)",
        "growth_corners.largest.kafka_freeze_p99_ms_records_on",
        "<",
        200,
    ),
    Target(
        "replay entries/s, largest ÷ smallest shape (delta records on)",
        "growth_corners.largest_vs_smallest.replay_entries_per_s_records_on",
        ">=",
        0.5,
        "self",
    ),
    Target(
        "Kafka resolve p99 under the main load, probed from a model-server process (ms)",
        "resolve.figures.probe_p99_ms",
        "<",
        20,
    ),
    Target("file staging MB/s ÷ file floor, MoE", "staging.ratios.moe.tokcap_vs_floor", ">=", 0.5, "floor"),
    Target(
        "file staging MB/s ÷ file floor, image", "staging.ratios.image.tokcap_vs_floor", ">=", 0.5, "floor"
    ),
    Target("file staging MB/s ÷ straw-queue, MoE", "staging.ratios.moe.tokcap_vs_straw", ">=", 1, "straw"),
    Target(
        "file staging MB/s ÷ straw-queue, image", "staging.ratios.image.tokcap_vs_straw", ">=", 1, "straw"
    ),
    Target(
        "Kafka staging MB/s ÷ Kafka floor, MoE", "staging.ratios.moe.kafka_vs_kafka_floor", ">=", 0.5, "floor"
    ),
    Target(
        "Kafka staging MB/s ÷ Kafka floor, image",
        "staging.ratios.image.kafka_vs_kafka_floor",
        ">=",
        0.5,
        "floor",
    ),
    Target(
        "ledger record p99 beside the stagers, MoE (ms)",
        "staging.figures.moe.tokcap_ledger_thread.ledger_p99_ms",
        "<",
        10,
    ),
    Target("64-call chain fetch p99 (ms)", "staging.figures.chain_fetch_p99_ms", "<", 20),
)


def lookup(results: Mapping[str, Any], path: str) -> float:
    """The number at a dotted path of the results; NaN when the run did not measure it."""
    value: Any = results
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return math.nan
        value = value[part]
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def evaluate(results: Mapping[str, Any], targets: tuple[Target, ...] = TARGETS) -> list[dict[str, Any]]:
    """Each target of a scenario the run measured, with its value and whether it is met (``None``: not measured)."""
    rows = []
    for target in targets:
        if target.scenario not in results:
            continue
        value = lookup(results, target.path)
        measured = not math.isnan(value)
        rows.append(
            {
                "target": target.figure,
                "goal": target.goal,
                "anchor": target.anchor,
                "path": target.path,
                "value": value if measured else None,
                "met": target.met(value) if measured else None,
            }
        )
    return rows

"""The freeze-phases scenario splits each Kafka freeze with tokcap's public metrics, against a real broker.

No figure is checked against a target, only that every freeze of the trial is counted once and that the
materializer's part of a freeze (read off the log to answered) fits inside the source's whole call.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.trials import freeze_phases


def test_every_freeze_is_counted_and_the_materializers_part_fits_inside_the_sources_call(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    figures = asyncio.run(freeze_phases(tmp_path, kafka_bootstrap, rollouts=3))
    assert figures["freezes"] == 6, "3 slots x 2 rounds, each rollout frozen once"
    assert 0 < figures["answer_mean_ms"] <= figures["call_mean_ms"]
    assert 0 < figures["answer_share"] <= 1
    assert figures["freeze_p50_ms"] <= figures["freeze_p99_ms"]


def test_a_second_trial_in_the_same_process_counts_only_its_own_freezes(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    asyncio.run(freeze_phases(tmp_path / "first", kafka_bootstrap, rollouts=2))
    figures = asyncio.run(freeze_phases(tmp_path / "second", kafka_bootstrap, rollouts=3))
    assert figures["freezes"] == 6


def test_with_the_materializer_in_its_own_process_its_scraped_parts_fit_inside_the_sources_call(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    figures = asyncio.run(freeze_phases(tmp_path, kafka_bootstrap, rollouts=3, external=True))
    assert figures["freezes"] == 6
    assert figures["read_delay_mean_ms"] > 0 and figures["answer_mean_ms"] > 0
    # Log timestamps have millisecond resolution: the parts may overrun the call by that much, no more.
    assert figures["source_own_mean_ms"] > -1
    assert figures["freeze_p50_ms"] <= figures["freeze_p99_ms"]

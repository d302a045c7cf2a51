"""Projecting a whole run topic into an empty directory, the reference every byte-identity test compares to."""

from __future__ import annotations

from pathlib import Path

from transports.kafka.materializer import Materializer

__all__ = ["replay_topic"]


def replay_topic(bootstrap: str, topic: str, store_dir: Path, timeout_s: float = 180) -> None:
    """Replay the whole topic into ``store_dir`` with a fresh in-process materializer that is never killed."""
    materializer = Materializer(bootstrap, topic, store_dir)
    materializer.start()
    try:
        assert materializer.wait_until_caught_up(timeout_s), f"{topic} not applied within {timeout_s} s"
    finally:
        materializer.stop()

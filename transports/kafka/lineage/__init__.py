"""Gym's ``LineageResolver`` over a run topic (``resolver``): the name a config block writes is importable here.

``transports.kafka.lineage:KafkaLineageResolver`` is what Gym's ``lineage_store`` names; the reading of a
rollout's partition (``partition_reader``) and what is kept of each rollout (``rollout_logs``) stand beside it.
"""

from transports.kafka.lineage.resolver import KafkaLineageResolver

__all__ = ["KafkaLineageResolver"]

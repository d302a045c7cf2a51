"""Every scenario ``python -m bench`` runs, as data: what load, which stores or transports, compared against what.

A scenario's variants take turns inside one run (``bench.harness``); ``anchor`` names the variant its ratios
divide by. Scenarios with a ``trial`` run each trial in a fresh interpreter (``bench.trials``); those with
``baseline`` compare this checkout with another one given by ``--baseline``. The rest are sections measured in
this process by ``bench.suite``. ``default`` marks the scenarios a plain ``python -m bench`` runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["DEFAULT", "SCENARIOS", "Scenario", "by_name"]


@dataclass(frozen=True)
class Scenario:
    """One named comparison: its load, the variants that take turns, and the one its ratios are to."""

    name: str
    load: str
    variants: tuple[str, ...]
    anchor: str | None = None
    kafka: bool = False
    """Needs a broker; without one it is skipped."""
    starts_broker: bool = True
    """Without ``--bootstrap``, a local broker is started for it (its Kafka side, or all of it, needs one)."""
    default: bool = False
    trial: str | None = None
    """A function of ``bench.trials``: each trial of each variant runs it in a fresh interpreter."""
    baseline: bool = False
    """Its variants are this checkout and ``--baseline``; it cannot run without one."""
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    """Per variant, the keyword settings its trial function gets on top of the run's."""
    shown: tuple[str, ...] = ()
    """The figures printed per trial and in the medians table."""


_MAIN_LOAD = (
    "the main load: 64 concurrent rollouts x 2 rounds, 8 turns, 1k system prompt, 200 generated + 100 tool "
    "tokens a turn; intent + put per turn, freeze when a rollout ends"
)
_LOAD_FIGURES = ("puts_per_s", "vs_gym", "freeze_p50_ms", "freeze_p99_ms")

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "main",
        _MAIN_LOAD
        + "; physical references (fsync, syncfs, rename, create, orjson encode + write) in each trial; the "
        "Kafka variant's topic has 2 partitions, replayed by one process, by one worker process and by one "
        "per partition",
        ("reference", "call_costs", "gym", "file", "kafka", "kafka_ext", "kafka_split"),
        anchor="gym",
        default=True,
    ),
    Scenario(
        "batch",
        "200 rollouts x 4 turns written 32 at a time, then all frozen at once",
        ("gym", "file", "kafka"),
        anchor="gym",
        default=True,
    ),
    Scenario(
        "workers",
        "a 4-partition topic of 1,000 rollouts x 8 turns applied from offset 0 into an empty directory",
        ("1", "2"),
        anchor="1",
        kafka=True,
        default=True,
    ),
    Scenario(
        "growth",
        "8 concurrent rollouts x 2 rounds per shape, 4/16/64 turns x 1k/32k prompt",
        ("file", "file_delta", "kafka_wire_off", "kafka_wire_on", "kafka_records_on"),
        default=True,
    ),
    Scenario(
        "resolve",
        "lineage resolve under the main load: a probe process resolving and putting on the run topic, and the "
        "main shape's rollouts resolving then putting in one process, over Kafka and over the file store",
        ("probe", "closed_loop", "file_closed_loop"),
        kafka=True,
        default=True,
    ),
    Scenario(
        "resolve_long",
        "one rollout of 1,000 and of 2,000 calls as delta records; 40 warm resolves each, then 5 prefix-merging "
        "builds of the frozen rollout",
        ("tokcap FileLineageResolver", "Gym 0.7.0 FileLineageStore", "tokcap KafkaLineageResolver"),
        anchor="Gym 0.7.0 FileLineageStore",
    ),
    Scenario(
        "intents",
        "1,000, 2,000 and 4,000 intent + cancel pairs on one rollout: applied as a projection does, and durably",
        ("projected", "durable"),
        starts_broker=False,
    ),
    Scenario(
        "metrics_cost",
        "the metrics' timing decorator around a call that does nothing, and 1,000 file-store puts a trial "
        "through the decorated and the bare put; the smallest trial of each",
        ("bare", "timed"),
        anchor="bare",
        starts_broker=False,
        shown=("us_per_call", "us_per_put", "decorator_us", "decorator_share_of_put"),
    ),
    Scenario(
        "staging",
        "engine-side staging from 16 threads: 320 MoE calls (1 MB extras) and 64 calls with a 4 MiB image",
        (
            "floor",
            "tokcap",
            "tokcap_ledger_thread",
            "tokcap_ledger_process",
            "straw",
            "kafka_floor",
            "kafka",
            "kafka_ledger_thread",
        ),
        anchor="floor",
        starts_broker=False,
    ),
    Scenario(
        "ledger_start",
        "a topic of 10,000 staged calls (1,000 rollouts x 10, 256 KiB attachment + 300 tokens each) and their "
        "ledger rows, and a topic of the rows alone: a model server's ledger from construction to its first "
        "manifest",
        ("ledger_only", "rows_only", "whole", "read_floor"),
        anchor="whole",
        kafka=True,
        shown=("start_s", "cpu_s", "dir_mb"),
    ),
    Scenario(
        "journal_crash",
        "NeMo RL's loop (4 rollouts a step, 3 staged calls each, a snapshot every 2 steps) SIGKILLed 4 times at "
        "seeded points (mid-stage, between cursor and snapshot, mid-restage) and restored; generation-seconds "
        "lost per crash, then the cost of one stage beside the floors",
        ("memory", "file", "kafka", "file_floor", "kafka_floor"),
        anchor="memory",
    ),
    Scenario(
        "file_floor",
        "the main load; the file work alone (append, hash, state rename, one syncfs per 6 puts) beside the stores "
        "and the load's driver with only the hop to a writer thread",
        ("floor", "gym", "file", "hop"),
        anchor="gym",
        starts_broker=False,
        shown=("puts_per_s", "cpu_us_per_put"),
    ),
    Scenario(
        "freeze_phases",
        "the main load; Kafka only, every freeze's time split by the public metrics (source call, read delay, "
        "read → answered, the source's own rest), the materializer in the load's process or in its own "
        "(scraped from its `/metrics`)",
        ("kafka", "kafka_ext"),
        kafka=True,
        trial="freeze_phases",
        settings=MappingProxyType({"kafka": {"external": False}, "kafka_ext": {"external": True}}),
        shown=(
            "freeze_p50_ms",
            "freeze_p99_ms",
            "call_mean_ms",
            "read_delay_mean_ms",
            "answer_mean_ms",
            "source_own_mean_ms",
        ),
    ),
    Scenario(
        "trainer_first",
        "the main load; sinks here, source and materializer in a trainer process; the load niced or not",
        ("equal", "trainer_first"),
        anchor="equal",
        kafka=True,
        trial="trainer_split",
        settings=MappingProxyType({"equal": {"nice": 0}, "trainer_first": {"nice": 19}}),
        shown=("freeze_p50_ms", "freeze_p99_ms", "freeze_max_ms", "puts_per_s", "niceness"),
    ),
    Scenario(
        "file_store_ab",
        "the main load; Gym's store then the tree's file store in each trial",
        ("this", "baseline"),
        anchor="baseline",
        trial="file_store",
        baseline=True,
        starts_broker=False,
        shown=(*_LOAD_FIGURES, "puts_per_sync", "cpu_s"),
    ),
    Scenario(
        "kafka_ab",
        "the main load; Gym's store, then the tree's Kafka sink and source, then a replay of the topic",
        ("this", "baseline"),
        anchor="baseline",
        kafka=True,
        trial="kafka",
        baseline=True,
        shown=(*_LOAD_FIGURES, "replay_per_s", "backlog"),
    ),
    Scenario(
        "apply_ab",
        "the main load over Kafka, then the apply step (decode + apply) over the topic alone",
        ("this", "baseline"),
        anchor="baseline",
        kafka=True,
        trial="apply_rate",
        baseline=True,
        shown=("events_per_s", "tokens_per_s", "us_per_put", "cpu_us_per_event", "events"),
    ),
    Scenario(
        "apply_cost",
        "the main load; CPU per event of the apply step and per intent + put of the file sink, one call at a "
        "time from one thread, Gym's store beside them",
        ("this", "baseline"),
        anchor="baseline",
        trial="apply_cost",
        baseline=True,
        starts_broker=False,
        settings=MappingProxyType({"baseline": {"gym": False}}),
        shown=(
            "apply.intent_us",
            "apply.put_us",
            "apply.freeze_us",
            "apply.block_end_us_per_event",
            "apply.projection_us_per_event",
            "sink.put_us",
            "sink.intent_put_us",
            "sink.freeze_us",
            "load.cpu_us_per_put",
            "gym.intent_put_us",
            "gym_load.cpu_us_per_put",
        ),
    ),
    Scenario(
        "sends_ab",
        "64 senders each awaiting 60 sends of a 2 kB message through one producer bridge (acks=all)",
        ("this", "baseline"),
        anchor="baseline",
        kafka=True,
        trial="producer_sends",
        baseline=True,
        shown=("sends_per_s", "cpu_us_per_send", "p50_ms", "p99_ms"),
    ),
)

DEFAULT = tuple(scenario.name for scenario in SCENARIOS if scenario.default)
"""What a plain ``python -m bench`` runs, in order."""


def by_name(name: str) -> Scenario:
    """The scenario called ``name``; a ``KeyError`` naming the known ones otherwise."""
    for scenario in SCENARIOS:
        if scenario.name == name:
            return scenario
    raise KeyError(f"unknown scenario {name!r}; choose from {', '.join(s.name for s in SCENARIOS)}")

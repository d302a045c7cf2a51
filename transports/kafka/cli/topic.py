"""``tokcap topic create|describe|delete``: the run topic's life, from the operator's side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from tokcap.errors import InvalidInputError
from transports.kafka.cli.options import parse_key_values, resolve_run_topic
from transports.kafka.client.admin import delete_topic, describe_topic, probe_broker
from transports.kafka.client.clients import ClientContext
from transports.kafka.client.limits_record import read_topic_limits
from transports.kafka.client.topics import TopicSettings, ensure_topic, staged_payload_topic_for
from transports.kafka.errors import TopicNotFoundError
from transports.kafka.wire.topic_limits import TOPIC_DEFAULTS, TopicLimits

__all__ = ["create_topic", "delete", "describe", "render_description"]


def create_topic(
    bootstrap: str,
    *,
    run_id: str | None,
    topic: str | None,
    partitions: int,
    replication_factor: int,
    config: Sequence[str],
    client_options: Sequence[str],
    timeout_s: float,
    max_event_bytes: int | None = None,
    max_open_chunk_bytes: int | None = None,
) -> dict[str, Any]:
    """Create the topic with its limits record, or accept an identical existing one; a different one is an error.

    Limits not given are the defaults; an existing topic is checked against the limits given.
    """
    name = resolve_run_topic(run_id, topic)
    topic_config = parse_key_values(config, "--config")
    client_config = parse_key_values(client_options, "-X")
    settings = TopicSettings(
        partitions=partitions, replication_factor=replication_factor, config=topic_config
    )
    limits = None
    if max_event_bytes is not None or max_open_chunk_bytes is not None:
        limits = TopicLimits(
            max_event_bytes=TOPIC_DEFAULTS.max_event_bytes if max_event_bytes is None else max_event_bytes,
            max_open_chunk_bytes=max_open_chunk_bytes or 0,
        )
    probe_broker(bootstrap, client_config=client_config, timeout_s=timeout_s)
    created = ensure_topic(
        bootstrap, name, settings, admin_config=client_config, timeout_s=max(timeout_s, 30.0), limits=limits
    )
    recorded = read_topic_limits(ClientContext(bootstrap, client_config), name, timeout_s=timeout_s)
    return {
        "topic": name,
        "created": created,
        "partitions": partitions,
        "replication_factor": replication_factor,
        "config": settings.topic_config,
        "limits": recorded.to_dict(),
    }


def describe(
    bootstrap: str,
    *,
    run_id: str | None,
    topic: str | None,
    client_options: Sequence[str],
    timeout_s: float,
) -> dict[str, Any]:
    """The topic's partitions, replicas, offsets and durability configs."""
    name = resolve_run_topic(run_id, topic)
    client_config = parse_key_values(client_options, "-X")
    probe_broker(bootstrap, client_config=client_config, timeout_s=timeout_s)
    return describe_topic(bootstrap, name, client_config=client_config, timeout_s=timeout_s).to_dict()


def delete(
    bootstrap: str,
    *,
    run_id: str | None,
    topic: str | None,
    confirmed: bool,
    client_options: Sequence[str],
    timeout_s: float,
) -> dict[str, Any]:
    """Delete the topic and its staged-payload topic; refuse without ``--yes``: the run can never be replayed after.

    The payload topic is found by its name (``tokcap-staged.<topic>``), so deleting needs no right to read the
    run; it goes second, so a failure in between leaves a run topic whose references still resolve.
    """
    name = resolve_run_topic(run_id, topic)
    client_config = parse_key_values(client_options, "-X")
    if not confirmed:
        raise InvalidInputError(
            f"deleting {name!r} removes the only copy of the run's log (no replay afterwards); pass --yes to confirm"
        )
    probe_broker(bootstrap, client_config=client_config, timeout_s=timeout_s)
    delete_topic(bootstrap, name, client_config=client_config, timeout_s=max(timeout_s, 30.0))
    deleted: dict[str, Any] = {"topic": name, "deleted": True}
    payload_topic = staged_payload_topic_for(name)
    if payload_topic is not None and _delete_if_present(bootstrap, payload_topic, client_config, timeout_s):
        deleted["staged_payload_topic"] = payload_topic
    return deleted


def _delete_if_present(bootstrap: str, topic: str, client_config: dict[str, Any], timeout_s: float) -> bool:
    """Delete ``topic``; ``False`` when there is none (a topic made before staged-payload topics has none)."""
    try:
        delete_topic(bootstrap, topic, client_config=client_config, timeout_s=max(timeout_s, 30.0))
    except TopicNotFoundError:
        return False
    return True


def render_description(description: dict[str, Any], console: Console) -> None:
    """A partition table with the durability configs under it."""
    topic_id = description.get("topic_id")
    title = (
        f"{description['topic']}{f' (id {topic_id})' if topic_id else ''}: {description['messages']} messages"
    )
    table = Table(title=title, title_justify="left")
    for column in ("partition", "leader", "replicas", "in sync", "low", "high"):
        table.add_column(
            column, justify="right" if column in {"partition", "leader", "low", "high"} else "left"
        )
    for partition in description["partitions"]:
        in_sync = ",".join(map(str, partition["in_sync_replicas"]))
        if partition["under_replicated"]:
            in_sync += " (under-replicated)"
        table.add_row(
            str(partition["partition"]),
            str(partition["leader"]),
            ",".join(map(str, partition["replicas"])),
            in_sync,
            str(partition["low_offset"]),
            str(partition["high_offset"]),
        )
    console.print(table)
    for key, value in (description.get("limits") or {}).items():
        console.print(f"{key} = {value} (the topic's limit: every sink and reader uses it)")
    for key, value in description["configs"].items():
        console.print(f"{key} = {value if value is not None else '(not reported)'}")
    for warning in description["warnings"]:
        console.print(f"warning: {warning}")

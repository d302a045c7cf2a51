"""The Kafka commands of ``tokcap``, and the Kafka part of ``demo``, ``inspect`` and ``staging status``, mounted on
the core app.

``mount`` registers ``materialize``, ``replay``, ``log`` and ``topic`` on the ``tokcap`` app and returns the
``MountedTransport`` the core ``demo`` and ``inspect`` reach Kafka through. Each command imports its module,
and with it the Kafka client, only when it runs: ``tokcap demo`` and ``tokcap inspect`` start without it, and
a command run without the ``kafka`` extra fails with the line naming the extra (``tokcap.cli.errors``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tokcap.cli.console import emit_json, progress_console, stdout_console
from tokcap.cli.demo import DemoReport, DemoSettings, ProgressCallback
from tokcap.cli.metrics_http import DEFAULT_METRICS_HOST
from tokcap.cli.options import JsonFlag, Timeout
from transports.kafka.cli.side_files import describe_side_files, render_side_files

__all__ = [
    "KafkaCommandLine",
    "log",
    "materialize",
    "mount",
    "replay",
    "topic_app",
    "topic_create",
    "topic_delete",
    "topic_describe",
]

topic_app = typer.Typer(
    help="Create, describe or delete the Kafka topic of a run.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

_Bootstrap = Annotated[
    str,
    typer.Option(
        "--bootstrap",
        "-b",
        envvar="TOKCAP_KAFKA_BOOTSTRAP",
        help="Kafka bootstrap servers, HOST:PORT[,HOST:PORT]; defaults to $TOKCAP_KAFKA_BOOTSTRAP.",
    ),
]
_RunId = Annotated[str | None, typer.Option("--run", help="The run id; its topic is tokcap.RUN.")]
_TopicName = Annotated[str | None, typer.Option("--topic", help="An explicit topic name instead of --run.")]
_ClientOptions = Annotated[
    list[str] | None,
    typer.Option(
        "--kafka-option",
        "-X",
        help="A librdkafka setting KEY=VALUE for every client (repeatable), e.g. -X security.protocol=SASL_SSL.",
    ),
]


@dataclass(frozen=True)
class KafkaCommandLine:
    """Kafka's part of the core commands: ``demo --bootstrap``, the side files ``inspect`` shows and
    ``staging status --bootstrap``."""

    logger_name: str = "transports.kafka"

    def run_demo(
        self,
        settings: DemoSettings,
        bootstrap: str,
        run_id: str,
        *,
        servers: int,
        partitions: int,
        directory: Path | None,
        keep: bool,
        on_progress: ProgressCallback | None,
        broker_timeout_s: float,
    ) -> DemoReport:
        """The demo workload over Kafka sinks, a Kafka source and its materializer."""
        from transports.kafka.cli.demo import run_demo_over_kafka

        return run_demo_over_kafka(
            settings,
            bootstrap,
            run_id,
            servers=servers,
            partitions=partitions,
            directory=directory,
            keep=keep,
            on_progress=on_progress,
            broker_timeout_s=broker_timeout_s,
        )

    def describe_side_files(self, directory: Path) -> dict[str, Any]:
        """Checkpoints, owner records and dead letters a materializer left in ``directory``."""
        return describe_side_files(directory)

    def render_side_files(self, description: Mapping[str, Any], console: Console) -> None:
        """One line per side file, under the table of rollouts."""
        render_side_files(description, console)

    def staging_status(
        self,
        bootstrap: str,
        *,
        run_id: str | None,
        topic: str | None,
        client_options: Sequence[str],
        timeout_s: float,
        cursors: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, Any]:
        """The run topic applied to a scratch store, then the file store's staging status of it."""
        from transports.kafka.cli.staging_status import topic_staging_status

        return topic_staging_status(
            bootstrap,
            run_id=run_id,
            topic=topic,
            client_options=client_options,
            timeout_s=timeout_s,
            cursors=cursors,
        )


def mount(app: typer.Typer) -> KafkaCommandLine:
    """Register the Kafka commands on ``app``; return what ``demo`` and ``inspect`` reach Kafka through."""
    app.command()(materialize)
    app.command()(replay)
    app.command()(log)
    app.add_typer(topic_app, name="topic")
    return KafkaCommandLine()


def materialize(
    bootstrap: _Bootstrap,
    directory: Annotated[Path, typer.Option("--dir", help="The store directory this materializer owns.")],
    run: _RunId = None,
    topic: _TopicName = None,
    partitions: Annotated[
        str | None, typer.Option(help="Partitions to apply, e.g. 0-3,6 (default: all).")
    ] = None,
    workers: Annotated[
        int,
        typer.Option(help="Worker processes, each applying a disjoint subset of the partitions.", min=1),
    ] = 1,
    until_caught_up: Annotated[
        bool, typer.Option("--until-caught-up", help="Stop once everything in the log at start is applied.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between lag reports.", min=0.1)] = 2.0,
    block_messages: Annotated[
        int | None,
        typer.Option(
            help="Most messages applied per durable block before a checkpoint (default 1000). Smaller blocks "
            "checkpoint more often; larger ones write each rollout's state fewer times.",
            min=1,
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Serve Prometheus /metrics and a /healthz readiness check on this port (0: any free port).",
            min=0,
            max=65535,
        ),
    ] = None,
    metrics_host: Annotated[
        str, typer.Option(help="The address --metrics-port listens on.")
    ] = DEFAULT_METRICS_HOST,
    kafka_option: _ClientOptions = None,
    timeout: Timeout = 10.0,
) -> None:
    """Apply the run topic to a store directory until SIGINT/SIGTERM, showing lag per partition."""
    from transports.kafka.cli.materialize import run_materializer

    run_materializer(
        bootstrap,
        directory,
        run_id=run,
        topic=topic,
        partitions=partitions,
        workers=workers,
        until_caught_up=until_caught_up,
        interval_s=interval,
        block_messages=block_messages,
        client_options=kafka_option or [],
        timeout_s=timeout,
        console=progress_console(),
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )


def replay(
    bootstrap: _Bootstrap,
    directory: Annotated[Path, typer.Option("--dir", help="An empty directory to rebuild the store in.")],
    run: _RunId = None,
    topic: _TopicName = None,
    rollout: Annotated[str | None, typer.Option(help="Replay only this rollout's events.")] = None,
    until: Annotated[
        str,
        typer.Option(help="'end' (the log at start) or PARTITION:OFFSET[,...]: apply offsets below these."),
    ] = "end",
    force: Annotated[
        bool, typer.Option("--force", help="Replay into a directory that already has files.")
    ] = False,
    kafka_option: _ClientOptions = None,
    timeout: Timeout = 10.0,
    as_json: JsonFlag = False,
) -> None:
    """Rebuild a store from the run's log into an empty directory."""
    from transports.kafka.cli.replay import render_replay, run_replay

    summary = run_replay(
        bootstrap,
        directory,
        run_id=run,
        topic=topic,
        rollout_id=rollout,
        until=until,
        force=force,
        client_options=kafka_option or [],
        timeout_s=timeout,
        show_progress=not as_json,
    )
    if as_json:
        emit_json(summary)
    else:
        render_replay(summary, stdout_console())


def log(
    bootstrap: _Bootstrap,
    rollout: Annotated[str, typer.Option(help="The rollout whose events to show.")],
    run: _RunId = None,
    topic: _TopicName = None,
    kafka_option: _ClientOptions = None,
    timeout: Timeout = 10.0,
    as_json: JsonFlag = False,
) -> None:
    """The event timeline of one rollout, with what the apply step decided for each event."""
    from transports.kafka.cli.log import render_timeline, rollout_timeline

    timeline = rollout_timeline(
        bootstrap, rollout, run_id=run, topic=topic, client_options=kafka_option or [], timeout_s=timeout
    )
    if as_json:
        emit_json(timeline)
    else:
        render_timeline(timeline, stdout_console())


@topic_app.command("create")
def topic_create(
    bootstrap: _Bootstrap,
    run: _RunId = None,
    topic: _TopicName = None,
    partitions: Annotated[int, typer.Option(help="Partitions; rollouts spread over them by key.", min=1)] = 1,
    replication_factor: Annotated[int, typer.Option(help="Copies of each partition.", min=1)] = 1,
    config: Annotated[
        list[str] | None, typer.Option("--config", "-c", help="Topic config KEY=VALUE (repeatable).")
    ] = None,
    kafka_option: _ClientOptions = None,
    timeout: Timeout = 10.0,
    as_json: JsonFlag = False,
    max_event_bytes: Annotated[
        int | None,
        typer.Option(
            help="Largest event, in bytes, every sink and reader of the topic takes (default 256 MiB).", min=1
        ),
    ] = None,
    max_open_chunk_bytes: Annotated[
        int | None,
        typer.Option(
            help="Bytes of open chunk groups a reader holds per partition (default twice the event limit).",
            min=1,
        ),
    ] = None,
) -> None:
    """Create the run topic with its limits; an existing topic with the same settings is fine, others are an error."""
    from transports.kafka.cli.topic import create_topic

    result = create_topic(
        bootstrap,
        run_id=run,
        topic=topic,
        partitions=partitions,
        replication_factor=replication_factor,
        config=config or [],
        client_options=kafka_option or [],
        timeout_s=timeout,
        max_event_bytes=max_event_bytes,
        max_open_chunk_bytes=max_open_chunk_bytes,
    )
    if as_json:
        emit_json(result)
    else:
        stdout_console().print(
            f"topic {result['topic']}: {'created' if result['created'] else 'already exists'}, limits "
            f"max_event_bytes={result['limits']['max_event_bytes']}, "
            f"max_open_chunk_bytes={result['limits']['max_open_chunk_bytes']}"
        )


@topic_app.command("describe")
def topic_describe(
    bootstrap: _Bootstrap,
    run: _RunId = None,
    topic: _TopicName = None,
    kafka_option: _ClientOptions = None,
    timeout: Timeout = 10.0,
    as_json: JsonFlag = False,
) -> None:
    """Partitions, leaders, replicas, in-sync replicas, offsets and the configs that matter for durability."""
    from transports.kafka.cli.topic import describe, render_description

    description = describe(
        bootstrap, run_id=run, topic=topic, client_options=kafka_option or [], timeout_s=timeout
    )
    if as_json:
        emit_json(description)
    else:
        render_description(description, stdout_console())


@topic_app.command("delete")
def topic_delete(
    bootstrap: _Bootstrap,
    run: _RunId = None,
    topic: _TopicName = None,
    yes: Annotated[
        bool, typer.Option("--yes", help="Confirm: the run's log cannot be replayed afterwards.")
    ] = False,
    kafka_option: _ClientOptions = None,
    timeout: Timeout = 10.0,
    as_json: JsonFlag = False,
) -> None:
    """Delete the run topic, and with it every way to replay the run."""
    from transports.kafka.cli.topic import delete

    result = delete(
        bootstrap,
        run_id=run,
        topic=topic,
        confirmed=yes,
        client_options=kafka_option or [],
        timeout_s=timeout,
    )
    if as_json:
        emit_json(result)
    else:
        stdout_console().print(f"topic {result['topic']}: deleted")

"""The ``tokcap`` command: run the demo, inspect a store, and operate and debug the Kafka transport.

Commands that talk to Kafka import ``transports.kafka`` only when they run, so ``tokcap demo`` and
``tokcap inspect`` work without the ``kafka`` extra.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from tokcap.cli.console import emit_json, progress_console, stdout_console
from tokcap.cli.demo import DemoSettings, run_demo_over_files, run_demo_over_kafka
from tokcap.cli.inspect import describe_rollout, describe_store
from tokcap.cli.views import render_demo, render_rollout, render_store
from tokcap.errors import InvalidInputError

__all__ = [
    "app",
    "demo",
    "inspect",
    "log",
    "materialize",
    "replay",
    "topic_app",
    "topic_create",
    "topic_delete",
    "topic_describe",
]

app = typer.Typer(
    name="tokcap",
    help="Capture, replay and debug the training tokens of RL rollouts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
topic_app = typer.Typer(
    help="Create, describe or delete the Kafka topic of a run.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.add_typer(topic_app, name="topic")

_JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]
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
_Timeout = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for the broker before giving up.", min=0.1)
]


@app.callback()
def _configure(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log what tokcap and librdkafka do.")
    ] = False,
) -> None:
    """Logging goes to stderr; without --verbose only errors that no command reports itself are shown."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not verbose:
        # Commands report lost turns and masks in their own output; the library's log lines would repeat them.
        for name in ("tokcap", "transports"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


# ---------------------------------------------------------------------- demo


@app.command()
def demo(
    rollouts: Annotated[int, typer.Option(help="How many rollouts run concurrently.")] = 64,
    turns: Annotated[int, typer.Option(help="Model calls per rollout.")] = 4,
    prompt_tokens: Annotated[int, typer.Option(help="Tokens in each rollout's first prompt.")] = 512,
    generation_tokens: Annotated[int, typer.Option(help="Average tokens generated per call.")] = 64,
    tool_tokens: Annotated[int, typer.Option(help="Average tool-output tokens between calls.")] = 96,
    concurrency: Annotated[int, typer.Option(help="Rollouts in flight at once.")] = 32,
    faults: Annotated[
        bool, typer.Option(help="Inject a lost call, a failed write, a retry and a late write.")
    ] = True,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic tokens.")] = 0,
    directory: Annotated[
        Path | None, typer.Option("--dir", help="Store directory (absent or empty); kept after the run.")
    ] = None,
    keep_dir: Annotated[bool, typer.Option("--keep-dir", help="Keep the temporary store directory.")] = False,
    bootstrap: Annotated[
        str | None,
        typer.Option("--bootstrap", "-b", help="Run over Kafka at HOST:PORT instead of the file store."),
    ] = None,
    run: Annotated[
        str | None, typer.Option("--run", help="Run id over Kafka (default: demo-<random>).")
    ] = None,
    servers: Annotated[int, typer.Option(help="Model servers (Kafka sinks) over Kafka.")] = 3,
    partitions: Annotated[int, typer.Option(help="Partitions of the run topic over Kafka.")] = 3,
    engine_side: Annotated[
        bool,
        typer.Option(
            "--engine-side",
            help="Stage token deltas engine-side (Gym's external_staging) into the file store: staging sink, "
            "ledger, staging source, verify and finalize. No broker.",
        ),
    ] = False,
    timeout: _Timeout = 10.0,
    as_json: _JsonFlag = False,
) -> None:
    """Run a synthetic multi-turn agent workload end to end and print what happened."""
    settings = DemoSettings(
        rollouts=rollouts,
        turns=turns,
        prompt_tokens=prompt_tokens,
        generation_tokens=generation_tokens,
        tool_tokens=tool_tokens,
        concurrency=concurrency,
        faults=faults,
        seed=seed,
    )
    from tokcap.cli.progress import demo_progress

    if engine_side and bootstrap is not None:
        raise InvalidInputError("--engine-side runs on the file store; drop --bootstrap")
    with demo_progress(settings.rollouts, enabled=not as_json) as on_progress:
        if engine_side:
            from tokcap.cli.demo_staging import run_staging_demo_over_files

            report = run_staging_demo_over_files(settings, directory, keep_dir, on_progress)
        elif bootstrap is None:
            report = run_demo_over_files(settings, directory, keep_dir, on_progress)
        else:
            import uuid

            report = run_demo_over_kafka(
                settings,
                bootstrap,
                run or f"demo-{uuid.uuid4().hex[:8]}",
                servers=servers,
                partitions=partitions,
                directory=directory,
                keep=keep_dir,
                on_progress=on_progress,
                broker_timeout_s=timeout,
            )
    if as_json:
        emit_json(report.to_dict())
    else:
        render_demo(report.to_dict(), stdout_console())


# ------------------------------------------------------------------- inspect


@app.command()
def inspect(
    directory: Annotated[Path, typer.Argument(help="A store directory.")],
    rollout: Annotated[str | None, typer.Argument(help="One rollout to show in full.")] = None,
    as_json: _JsonFlag = False,
) -> None:
    """Show the rollouts of a store, or one rollout with its chain and mask verdict."""
    if rollout is None:
        description = describe_store(directory)
        if as_json:
            emit_json(description)
        else:
            render_store(description, stdout_console())
        return
    detail = describe_rollout(directory, rollout)
    if as_json:
        emit_json(detail)
    else:
        render_rollout(detail, stdout_console())


# ------------------------------------------------------------ Kafka commands


@app.command()
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
    kafka_option: _ClientOptions = None,
    timeout: _Timeout = 10.0,
) -> None:
    """Apply the run topic to a store directory until SIGINT/SIGTERM, showing lag per partition."""
    from tokcap.cli.materialize import run_materializer

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
    )


@app.command()
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
    timeout: _Timeout = 10.0,
    as_json: _JsonFlag = False,
) -> None:
    """Rebuild a store from the run's log into an empty directory."""
    from tokcap.cli.replay import run_replay

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
        from tokcap.cli.replay import render_replay

        render_replay(summary, stdout_console())


@app.command()
def log(
    bootstrap: _Bootstrap,
    rollout: Annotated[str, typer.Option(help="The rollout whose events to show.")],
    run: _RunId = None,
    topic: _TopicName = None,
    kafka_option: _ClientOptions = None,
    timeout: _Timeout = 10.0,
    as_json: _JsonFlag = False,
) -> None:
    """The event timeline of one rollout, with what the apply step decided for each event."""
    from tokcap.cli.log import render_timeline, rollout_timeline

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
    timeout: _Timeout = 10.0,
    as_json: _JsonFlag = False,
) -> None:
    """Create the run topic; an existing topic with the same settings is fine, one with others is an error."""
    from tokcap.cli.topic import create_topic

    result = create_topic(
        bootstrap,
        run_id=run,
        topic=topic,
        partitions=partitions,
        replication_factor=replication_factor,
        config=config or [],
        client_options=kafka_option or [],
        timeout_s=timeout,
    )
    if as_json:
        emit_json(result)
    else:
        stdout_console().print(
            f"topic {result['topic']}: {'created' if result['created'] else 'already exists'}"
        )


@topic_app.command("describe")
def topic_describe(
    bootstrap: _Bootstrap,
    run: _RunId = None,
    topic: _TopicName = None,
    kafka_option: _ClientOptions = None,
    timeout: _Timeout = 10.0,
    as_json: _JsonFlag = False,
) -> None:
    """Partitions, leaders, replicas, in-sync replicas, offsets and the configs that matter for durability."""
    from tokcap.cli.topic import describe, render_description

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
    timeout: _Timeout = 10.0,
    as_json: _JsonFlag = False,
) -> None:
    """Delete the run topic, and with it every way to replay the run."""
    from tokcap.cli.topic import delete

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

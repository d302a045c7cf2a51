"""The ``tokcap`` command: run the demo, inspect a store and its staging journal; a mounted transport adds its own
commands.

The core imports no transport. A transport declares its ``mount`` in the ``tokcap.transports`` entry-point
group; ``_mount_transports`` finds it there, registers its commands (Kafka's ``materialize``, ``replay``,
``log``, ``topic``) and keeps the ``MountedTransport`` that ``demo --bootstrap`` and ``inspect`` reach Kafka
through. The Kafka package
loads its client only when one of its commands runs, so ``tokcap demo`` and ``tokcap inspect`` work without
the ``kafka`` extra, and a Kafka command without it fails with one line naming the extra.
"""

from __future__ import annotations

import logging
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated

import typer

from tokcap.cli.console import emit_json, stdout_console
from tokcap.cli.demo import DemoSettings, run_demo_over_files
from tokcap.cli.inspect import describe_rollout, describe_store
from tokcap.cli.options import JsonFlag, Timeout
from tokcap.cli.picture import draw_rollout
from tokcap.cli.transport import MountedTransport
from tokcap.cli.views import render_demo, render_rollout, render_store
from tokcap.errors import ConfigError, InvalidInputError

__all__ = ["app", "demo", "inspect", "staging_app", "staging_status"]

app = typer.Typer(
    name="tokcap",
    help="Capture, replay and debug the training tokens of RL rollouts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


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
        for name in ("tokcap", *([] if _KAFKA is None else [_KAFKA.logger_name])):
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
    timeout: Timeout = 10.0,
    as_json: JsonFlag = False,
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

            report = _kafka("--bootstrap").run_demo(
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
    svg: Annotated[
        Path | None, typer.Option("--svg", help="Also draw the rollout's call tree to this SVG file.")
    ] = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="Also draw it to this HTML page, with a legend.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Show the rollouts of a store, or one rollout with its chain and mask verdict."""
    if rollout is None and (svg is not None or html is not None):
        raise InvalidInputError("--svg and --html draw one rollout: name it after the directory")
    if rollout is None:
        description = describe_store(directory, None if _KAFKA is None else _KAFKA.describe_side_files)
        if as_json:
            emit_json(description)
        else:
            console = stdout_console()
            render_store(description, console)
            if _KAFKA is not None:
                _KAFKA.render_side_files(description, console)
        return
    detail = describe_rollout(directory, rollout)
    drawn = draw_rollout(detail, svg=svg, html=html)
    if as_json:
        emit_json(detail)
    else:
        console = stdout_console()
        render_rollout(detail, console)
        for path in drawn:
            console.print(f"picture: {path}")


# ------------------------------------------------------------------- staging

staging_app = typer.Typer(
    help="The staging journal: what is staged and not yet retired.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.add_typer(staging_app, name="staging")


@staging_app.command("status")
def staging_status(
    directory: Annotated[Path | None, typer.Argument(help="A file store directory.")] = None,
    bootstrap: Annotated[
        str | None,
        typer.Option("--bootstrap", "-b", help="Read the run topic at HOST:PORT instead of a directory."),
    ] = None,
    run: Annotated[str | None, typer.Option("--run", help="The run id; its topic is tokcap.RUN.")] = None,
    topic: Annotated[
        str | None, typer.Option("--topic", help="An explicit topic name instead of --run.")
    ] = None,
    kafka_option: Annotated[
        list[str] | None,
        typer.Option("--kafka-option", "-X", help="A librdkafka setting KEY=VALUE (repeatable)."),
    ] = None,
    cursor_dir: Annotated[
        Path | None,
        typer.Option(
            "--cursor-dir",
            help="Where the trainer's JournaledStagingSink recorded its cursors (default: DIR; over Kafka, its "
            "sink's store_dir or cursor_dir).",
        ),
    ] = None,
    timeout: Timeout = 10.0,
    as_json: JsonFlag = False,
) -> None:
    """Staged calls not retired, per rollout (bytes, age, ledger rows), pending rollouts and cursors taken."""
    from tokcap.cli.staging_status import listed_cursors, render_staging_status
    from tokcap.cli.staging_status import staging_status as file_status

    if (directory is None) == (bootstrap is None):
        raise InvalidInputError("give a store directory, or --bootstrap HOST:PORT with --run RUN (not both)")
    if directory is not None and (run is not None or topic is not None or kafka_option):
        raise InvalidInputError(
            "--run, --topic and -X read a run topic: give them with --bootstrap, not a directory"
        )
    cursors = None if cursor_dir is None else listed_cursors(cursor_dir)
    if bootstrap is not None:
        status = _kafka("--bootstrap").staging_status(
            bootstrap,
            run_id=run,
            topic=topic,
            client_options=kafka_option or [],
            timeout_s=timeout,
            cursors=cursors or [],
        )
    else:
        assert directory is not None
        status = file_status(directory, cursors)
    if as_json:
        emit_json(status)
    else:
        render_staging_status(status, stdout_console())


# ------------------------------------------------------- the transport mounts


_TRANSPORT_GROUP = "tokcap.transports"
"""The entry-point group a transport registers its ``mount(app) -> MountedTransport`` under."""


def _mount_transports() -> dict[str, MountedTransport]:
    """Register every installed transport's commands on ``app``, by entry-point name.

    The core names no transport: each one declares its ``mount`` in the ``tokcap.transports`` entry-point
    group. A transport whose package is not installed beside ``tokcap`` is left out; any other import
    failure is a bug and is raised.
    """
    mounted: dict[str, MountedTransport] = {}
    for entry in entry_points(group=_TRANSPORT_GROUP):
        try:
            mount = entry.load()
        except ModuleNotFoundError as exc:
            module = entry.module
            if exc.name is None or not (module == exc.name or module.startswith(f"{exc.name}.")):
                raise
            continue
        mounted[entry.name] = mount(app)
    return mounted


_KAFKA = _mount_transports().get("kafka")


def _kafka(option: str) -> MountedTransport:
    """The mounted Kafka part, or a one-line error naming the extra that provides it."""
    if _KAFKA is None:
        raise ConfigError(
            f"{option} runs over Kafka, which is not installed: pip install 'tokcap[kafka]' "
            "(or `pip install -e '.[kafka]'` in a clone)"
        )
    return _KAFKA

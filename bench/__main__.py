"""``python -m bench``: the one entry point; ``--only`` picks scenarios of ``bench.scenarios`` by name."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from bench.broker import local_broker
from bench.markdown import update_readme
from bench.options import BenchOptions, WorkloadShape
from bench.report import print_report, write_json
from bench.scenarios import DEFAULT, SCENARIOS, by_name
from bench.suite import run_suite

__all__ = ["main", "parse_options"]

_README = Path(__file__).resolve().parent / "README.md"


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def _scenarios(text: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in chosen:
        try:
            by_name(name)
        except KeyError as error:
            raise argparse.ArgumentTypeError(str(error.args[0])) from None
    return tuple(scenario.name for scenario in SCENARIOS if scenario.name in chosen)


def _scenario_help() -> str:
    return "; ".join(
        f"{s.name}{' (default)' if s.default else ''}{' (--baseline)' if s.baseline else ''}"
        for s in SCENARIOS
    )


def parse_options(argv: Sequence[str] | None = None) -> tuple[BenchOptions, bool]:
    """Options from the command line, and whether to use a broker at all."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    shape = WorkloadShape()
    parser.add_argument(
        "--only", type=_scenarios, default=DEFAULT, help=f"comma-separated scenarios: {_scenario_help()}"
    )
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another checkout (git worktree add DIR REV)"
    )
    parser.add_argument(
        "--trials", "--repeats", dest="trials", type=int, default=3, help="trials per variant"
    )
    parser.add_argument("--rollouts", type=int, default=shape.rollouts, help="concurrent rollouts")
    parser.add_argument("--rounds", type=int, default=shape.rounds, help="rollouts each slot runs in turn")
    parser.add_argument("--turns", type=int, default=shape.turns, help="model calls per rollout")
    parser.add_argument("--prompt-tokens", type=int, default=shape.prompt_tokens, help="system prompt tokens")
    parser.add_argument("--generated-tokens", type=int, default=shape.generated_tokens, help="per turn")
    parser.add_argument("--tool-tokens", type=int, default=shape.tool_tokens, help="tool output per turn")
    parser.add_argument("--seed", type=int, default=shape.seed)
    parser.add_argument("--bootstrap", default=None, help="use this broker instead of starting a local one")
    parser.add_argument(
        "--no-kafka", action="store_true", help="no broker: scenarios that need one are skipped"
    )
    parser.add_argument("--batch-rollouts", type=int, default=200, help="rollouts frozen at once (batch)")
    parser.add_argument("--workers-rollouts", type=int, default=1000, help="rollouts in the workers' topic")
    parser.add_argument(
        "--workers-turns", type=int, default=8, help="turns per rollout in the workers' topic"
    )
    parser.add_argument(
        "--growth-rollouts", type=int, default=8, help="concurrent rollouts in the growth grid"
    )
    parser.add_argument("--growth-turns", type=_int_list, default=(4, 16, 64))
    parser.add_argument("--growth-prompts", type=_int_list, default=(1000, 32000))
    parser.add_argument(
        "--straw", type=Path, default=None, help="staging: measure straw-queue, installed here"
    )
    parser.add_argument("--staging-calls", type=int, default=320, help="staging: MoE calls staged")
    parser.add_argument("--staging-images", type=int, default=64, help="staging: image calls staged")
    parser.add_argument("--staging-threads", type=int, default=16, help="staging: stager threads")
    parser.add_argument("--senders", type=int, default=64, help="sends_ab: concurrent senders")
    parser.add_argument("--sends", type=int, default=60, help="sends_ab: sends per sender")
    parser.add_argument("--crash-kills", type=int, default=4, help="journal_crash: SIGKILLs per transport")
    parser.add_argument("--crash-steps", type=int, default=12, help="journal_crash: trainer steps")
    parser.add_argument(
        "--dir", "--work-dir", dest="dir", type=Path, default=None, help="parent of trial dirs"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/latest.json"))
    parser.add_argument("--quick", action="store_true", help="small shapes and one trial, for a smoke run")
    parser.add_argument(
        "--update-readme",
        action="store_true",
        help="render this run into the results section of bench/README.md",
    )
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials must be 1 or more, got {args.trials}")
    needs_baseline = [name for name in args.only if by_name(name).baseline]
    if needs_baseline and args.baseline is None:
        parser.error(f"{', '.join(needs_baseline)} compare this checkout with another: give --baseline DIR")
    options = BenchOptions(
        shape=WorkloadShape(
            rollouts=args.rollouts,
            rounds=args.rounds,
            turns=args.turns,
            prompt_tokens=args.prompt_tokens,
            generated_tokens=args.generated_tokens,
            tool_tokens=args.tool_tokens,
            seed=args.seed,
        ),
        repeats=args.trials,
        bootstrap=args.bootstrap,
        growth_rollouts=args.growth_rollouts,
        growth_turns=args.growth_turns,
        growth_prompts=args.growth_prompts,
        work_dir=args.dir,
        output=args.output,
        update_readme=args.update_readme,
        only=args.only,
        batch_rollouts=args.batch_rollouts,
        workers_rollouts=args.workers_rollouts,
        workers_turns=args.workers_turns,
        workers_trials=args.trials,
        baseline=args.baseline,
        straw=args.straw,
        staging_calls=args.staging_calls,
        staging_images=args.staging_images,
        staging_threads=args.staging_threads,
        senders=args.senders,
        sends=args.sends,
        crash_kills=args.crash_kills,
        crash_steps=args.crash_steps,
    )
    if args.quick:
        options = replace(
            options,
            shape=replace(
                options.shape, rollouts=min(options.shape.rollouts, 16), turns=min(options.shape.turns, 4)
            ),
            repeats=1,
            growth_rollouts=2,
            growth_turns=(4, 16),
            growth_prompts=(1000, 8000),
            batch_rollouts=min(options.batch_rollouts, 40),
            workers_rollouts=min(options.workers_rollouts, 400),
            workers_turns=min(options.workers_turns, 4),
            workers_trials=1,
            staging_calls=min(options.staging_calls, 32),
            staging_images=min(options.staging_images, 8),
            senders=min(options.senders, 8),
            sends=min(options.sends, 10),
            long_rollouts=(200,),
            long_samples=10,
            long_build_trials=2,
            intent_pairs=(200, 400),
            metrics_puts=100,
            crash_kills=min(options.crash_kills, 3),
            crash_steps=min(options.crash_steps, 6),
        )
    wanted = args.bootstrap is not None or any(by_name(name).starts_broker for name in options.only)
    return options, wanted and not args.no_kafka


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen scenarios, print their tables, write the JSON results and, if asked, the README section."""
    options, with_kafka = parse_options(argv)
    command = "python -m bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=None if sys.stdout.isatty() else 200)
    with ExitStack() as stack:
        bootstrap = options.bootstrap
        if with_kafka and bootstrap is None:
            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tokcap-bench-broker-")))
            console.print("starting a local Kafka broker (scripts/kafka-broker) ...")
            bootstrap = stack.enter_context(local_broker(state_dir))
        results = run_suite(
            options, bootstrap if with_kafka else None, lambda text: console.print(f"[dim]{text}[/dim]")
        )
    results["command"] = command.strip()
    print_report(results, console)
    write_json(results, options.output)
    console.print(f"results written to {options.output}")
    if options.update_readme:
        update_readme(_README, results)
        console.print(f"{_README} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())

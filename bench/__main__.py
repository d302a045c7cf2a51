"""``python -m bench``: measure capture, freeze and replay for the file store and Kafka, side by side."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from bench.broker import local_broker
from bench.markdown import update_readme
from bench.options import SECTIONS, BenchOptions, WorkloadShape
from bench.report import print_report, write_json
from bench.suite import run_suite

__all__ = ["main", "parse_options"]

_README = Path(__file__).resolve().parent / "README.md"


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def _sections(text: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [part for part in chosen if part not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown section {', '.join(unknown)}; choose from {', '.join(SECTIONS)}"
        )
    return tuple(section for section in SECTIONS if section in chosen)


def parse_options(argv: Sequence[str] | None = None) -> tuple[BenchOptions, bool]:
    """Options from the command line, and whether to run the Kafka side at all."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    shape = WorkloadShape()
    parser.add_argument("--rollouts", type=int, default=shape.rollouts, help="concurrent rollouts")
    parser.add_argument("--rounds", type=int, default=shape.rounds, help="rollouts each slot runs in turn")
    parser.add_argument("--turns", type=int, default=shape.turns, help="model calls per rollout")
    parser.add_argument("--prompt-tokens", type=int, default=shape.prompt_tokens, help="system prompt tokens")
    parser.add_argument("--generated-tokens", type=int, default=shape.generated_tokens, help="per turn")
    parser.add_argument("--tool-tokens", type=int, default=shape.tool_tokens, help="tool output per turn")
    parser.add_argument("--seed", type=int, default=shape.seed)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    parser.add_argument("--bootstrap", default=None, help="use this broker instead of starting a local one")
    parser.add_argument("--no-kafka", action="store_true", help="measure the file store only")
    parser.add_argument(
        "--no-growth", action="store_true", help="skip the growth grid (same as leaving it out of --only)"
    )
    parser.add_argument(
        "--only",
        type=_sections,
        default=SECTIONS,
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--batch-rollouts", type=int, default=200, help="rollouts frozen at once in the batch section"
    )
    parser.add_argument("--workers-rollouts", type=int, default=1000, help="rollouts in the workers' topic")
    parser.add_argument(
        "--workers-turns", type=int, default=8, help="turns per rollout in the workers' topic"
    )
    parser.add_argument("--workers-trials", type=int, default=3, help="runs per worker count, alternating")
    parser.add_argument(
        "--growth-rollouts", type=int, default=8, help="concurrent rollouts in the growth grid"
    )
    parser.add_argument("--growth-turns", type=_int_list, default=(4, 16, 64))
    parser.add_argument("--growth-prompts", type=_int_list, default=(1000, 32000))
    parser.add_argument("--work-dir", type=Path, default=None, help="parent of the scratch directories")
    parser.add_argument("--output", type=Path, default=Path("bench/results/latest.json"))
    parser.add_argument("--quick", action="store_true", help="small shapes and one repeat, for a smoke run")
    parser.add_argument(
        "--update-readme", action="store_true", help="rewrite the results section of bench/README.md"
    )
    args = parser.parse_args(argv)
    if args.update_readme and (set(args.only) != set(SECTIONS) or args.no_kafka or args.no_growth):
        parser.error(
            "--update-readme rewrites every table, so it needs every section: drop --only/--no-kafka/--no-growth"
        )
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
        repeats=args.repeats,
        bootstrap=args.bootstrap,
        growth=not args.no_growth and "growth" in args.only,
        growth_rollouts=args.growth_rollouts,
        growth_turns=args.growth_turns,
        growth_prompts=args.growth_prompts,
        work_dir=args.work_dir,
        output=args.output,
        update_readme=args.update_readme,
        only=tuple(s for s in args.only if s != "growth" or not args.no_growth),
        batch_rollouts=args.batch_rollouts,
        workers_rollouts=args.workers_rollouts,
        workers_turns=args.workers_turns,
        workers_trials=args.workers_trials,
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
        )
    return options, not args.no_kafka


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the tables and write the JSON results."""
    options, with_kafka = parse_options(argv)
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
    print_report(results, console)
    write_json(results, options.output)
    console.print(f"results written to {options.output}")
    if options.update_readme:
        update_readme(_README, results)
        console.print(f"{_README} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())

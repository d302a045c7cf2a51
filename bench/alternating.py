"""Trials of this checkout and another one, alternating, each in a fresh interpreter: the A/B runs' loop.

A change is judged by trials run side by side: the machine's speed moves between runs, so a figure
compared across runs says more about the machine than about the change. The trees take turns (this,
baseline, then baseline, this, ...), so a slow stretch hits both. Each trial is a coroutine ``_trial``
defined in a bench file, run with the tree's ``tokcap`` and ``bench`` first on ``sys.path``; the file
itself is read from this checkout, so a baseline older than the file can still be measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "REPO",
    "ab_parser",
    "alternate",
    "alternate_arms",
    "print_medians",
    "run_against_baseline",
    "run_trial_file",
]

REPO = Path(__file__).resolve().parent.parent
"""The root of this checkout."""


def run_trial_file(
    trial_file: Path, tree: Path, directory: Path, arguments: Sequence[Any]
) -> dict[str, float]:
    """Run ``_trial(directory, *arguments)`` of ``trial_file`` against ``tree`` in a fresh interpreter."""
    code = (
        "import asyncio, json, runpy, sys; from pathlib import Path; "
        f"sys.path.insert(0, {str(tree)!r}); "
        f"trial = runpy.run_path({str(trial_file)!r})['_trial']; "
        f"print(json.dumps(asyncio.run(trial(Path({str(directory)!r}), *{list(arguments)!r}))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"trial of {tree} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def alternate(
    trial_file: Path,
    baseline: Path,
    trials: int,
    arguments: Sequence[Any],
    figures: Sequence[str],
    parent: Path | None,
) -> dict[str, list[dict[str, float]]]:
    """Run ``trials`` trials of this checkout and of ``baseline``, alternating; print each and the medians."""
    arms = {"this": (REPO, list(arguments)), "baseline": (baseline.resolve(), list(arguments))}
    return alternate_arms(trial_file, arms, trials, figures, parent)


def alternate_arms(
    trial_file: Path,
    arms: dict[str, tuple[Path, list[Any]]],
    trials: int,
    figures: Sequence[str],
    parent: Path | None,
) -> dict[str, list[dict[str, float]]]:
    """Run ``trials`` trials of each arm (a tree and its trial's arguments), alternating; print each and the medians.

    The arms take turns (first, second, then second, first, ...), so a slow stretch hits both. Trial
    directories are removed only after the last trial: ext4 charges a removal of thousands of files to the
    creates of the next half minute, which would slow the next arm's trial.
    """
    work = Path(tempfile.mkdtemp(prefix="tokcap-ab-", dir=parent))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    try:
        for trial in range(trials):
            order = list(arms) if trial % 2 == 0 else list(reversed(arms))
            for name in order:
                tree, arguments = arms[name]
                measured = run_trial_file(trial_file, tree, work / f"{name}-{trial}", arguments)
                results[name].append(measured)
                shown = " ".join(f"{key} {measured[key]:.2f}" for key in figures)
                print(f"trial {trial + 1} {name}: {shown}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_medians(results, figures)
    return results


def print_medians(results: dict[str, list[dict[str, float]]], figures: Sequence[str]) -> None:
    """Print each figure's median per arm (a tree, or a setting), one column per arm."""
    trials = max(len(measured) for measured in results.values())
    print(f"medians of {trials} trials:")
    print(f"{'figure':<16}" + "".join(f"{name:>14}" for name in results))
    for key in figures:
        medians = [statistics.median(measured[key] for measured in results[name]) for name in results]
        print(f"{key:<16}" + "".join(f"{value:>14.2f}" for value in medians))


def ab_parser(
    prog: str, doc: str, *, trials: int, kafka: bool, load: bool, baseline: bool = True
) -> argparse.ArgumentParser:
    """The arguments the trial commands share: the baseline, the trials, the broker, the load's shape and place.

    Without ``baseline`` the command's arms are settings of this checkout, not two trees.
    """
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    if baseline:
        parser.add_argument("--baseline", type=Path, required=True, help="another checkout (a git worktree)")
    if kafka:
        parser.add_argument("--bootstrap", required=True, help="the broker, HOST:PORT")
    arm = "tree" if baseline else "arm"
    parser.add_argument("--trials", type=int, default=trials, help=f"trials per {arm} (default {trials})")
    if load:
        parser.add_argument(
            "--rollouts", type=int, default=64, help="concurrent rollouts of the main shape (default 64)"
        )
        parser.add_argument(
            "--dir", type=Path, default=None, help="where trial directories go (default: a temp dir)"
        )
    return parser


def run_against_baseline(
    trial_file: Path,
    baseline: Path,
    needs: str,
    trials: int,
    arguments: Sequence[Any],
    figures: Sequence[str],
    parent: Path | None = None,
) -> int:
    """Alternate the trees and return 0; return 2, saying why, when the baseline lacks the ``needs`` directory."""
    if not (baseline / needs).is_dir():
        print(f"--baseline {baseline} holds no {needs}/; give a checkout of this repository")
        return 2
    alternate(trial_file, baseline, trials, arguments, figures, parent)
    return 0

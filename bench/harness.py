"""The one way the benchmarks compare things: trials of each variant, alternating, medians and ratios side by side.

The machine's speed moves between runs, so a figure compared across runs says more about the machine than
about the change. Every comparison here runs its variants in turns inside one run (a, b, then b, a, ...), so a
slow stretch hits all of them, and reports each figure's median per variant with its ratio to an anchor
variant beside it. A variant is a coroutine from a fresh trial directory to named figures; it runs in this
process or, through ``in_fresh_process``, in a new interpreter with a chosen tree first on ``sys.path`` (how a
checkout is measured against another one). Trial directories are removed only after the last trial: ext4
charges a removal of thousands of files to the creates of the next half minute, which would slow the next
variant's trial.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.stats import median

__all__ = [
    "REPO",
    "Progress",
    "Trials",
    "Variant",
    "alternate",
    "in_fresh_process",
    "machine_description",
    "machine_line",
    "turn_order",
]

REPO = Path(__file__).resolve().parent.parent
"""The root of this checkout."""

Variant = Callable[[Path], Awaitable[Mapping[str, float]]]
"""One side of a comparison: given a fresh trial directory, run one trial and return its figures."""

Progress = Callable[[str], None]


@dataclass
class Trials:
    """Every trial's figures per variant, in the order they ran."""

    runs: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    def summary(self, summarize: Callable[[Sequence[float]], float] = median) -> dict[str, dict[str, float]]:
        """Each variant's figures summarized over its trials (the median unless told otherwise)."""
        return {
            name: {key: summarize([trial[key] for trial in trials if key in trial]) for key in _keys(trials)}
            for name, trials in self.runs.items()
        }

    def ratios(
        self, anchor: str, summarize: Callable[[Sequence[float]], float] = median
    ) -> dict[str, dict[str, float]]:
        """Each variant's summarized figures divided by the anchor variant's same figure."""
        summary = self.summary(summarize)
        base = summary[anchor]
        return {
            name: {key: _ratio(value, base.get(key, math.nan)) for key, value in figures.items()}
            for name, figures in summary.items()
        }

    def result(self, anchor: str | None = None) -> dict[str, Any]:
        """The JSON-ready result of a side-by-side scenario: medians, ratios to the anchor, every trial."""
        return {
            "medians": self.summary(),
            "ratios": self.ratios(anchor) if anchor is not None else {},
            "runs": self.runs,
        }

    def merged(self, summarize: Callable[[Sequence[float]], float] = median) -> dict[str, float]:
        """All variants' summarized figures in one mapping, for variants whose figure names do not overlap."""
        merged: dict[str, float] = {}
        for figures in self.summary(summarize).values():
            merged.update(figures)
        return merged

    def flat_runs(self) -> dict[str, list[float]]:
        """Every figure's values over the trials, figure names as the variants returned them."""
        flat: dict[str, list[float]] = {}
        for trials in self.runs.values():
            for trial in trials:
                for key, value in trial.items():
                    flat.setdefault(key, []).append(value)
        return flat

    def table(self, figures: Sequence[str] | None = None, anchor: str | None = None) -> str:
        """Medians per variant, one column each, and with an anchor each variant's ratio to it beside."""
        summary = self.summary()
        names = list(self.runs)
        keys = list(figures) if figures is not None else sorted({k for f in summary.values() for k in f})
        trials = max((len(t) for t in self.runs.values()), default=0)
        heading = f"{'figure':<22}" + "".join(f"{name:>16}" for name in names)
        if anchor is not None:
            heading += "".join(f"{name + ' ÷ ' + anchor:>22}" for name in names if name != anchor)
        lines = [f"medians of {trials} trials:", heading]
        ratios = self.ratios(anchor) if anchor is not None else {}
        for key in keys:
            line = f"{key:<22}" + "".join(f"{summary[name].get(key, math.nan):>16.2f}" for name in names)
            if anchor is not None:
                line += "".join(
                    f"{ratios[name].get(key, math.nan):>22.2f}" for name in names if name != anchor
                )
            lines.append(line)
        return "\n".join(lines)


def _keys(trials: Sequence[Mapping[str, float]]) -> list[str]:
    keys: dict[str, None] = {}
    for trial in trials:
        keys.update(dict.fromkeys(trial))
    return list(keys)


def _ratio(value: float, base: float) -> float:
    return value / base if base and not math.isnan(base) else math.nan


def turn_order(names: Sequence[str], trial: int) -> list[str]:
    """The order variants run in at trial ``trial`` (from 0): as given, then reversed, and so on."""
    return list(names) if trial % 2 == 0 else list(reversed(names))


async def alternate(
    variants: Mapping[str, Variant],
    trials: int,
    parent: Path | None = None,
    progress: Progress | None = None,
    shown: Sequence[str] = (),
) -> Trials:
    """Run ``trials`` trials of every variant, the order reversed each trial; print each trial's ``shown`` figures.

    Each trial gets a fresh directory under ``parent`` (a temporary directory by default); all of them are
    removed after the last trial.
    """
    if trials < 1:
        raise ValueError(f"trials must be 1 or more, got {trials}")
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tokcap-trials-", dir=parent))
    result = Trials({name: [] for name in variants})
    try:
        for trial in range(trials):
            for name in turn_order(list(variants), trial):
                directory = work / f"{name}-{trial}"
                directory.mkdir(parents=True)
                measured = dict(await variants[name](directory))
                result.runs[name].append(measured)
                text = " ".join(f"{key} {measured[key]:.2f}" for key in shown if key in measured)
                say = progress or (lambda line: print(line, flush=True))
                say(f"trial {trial + 1} {name}: {text}".rstrip())
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
    return result


def in_fresh_process(
    trial_file: Path, function: str, settings: Mapping[str, Any], tree: Path = REPO
) -> Variant:
    """A variant that runs ``function(directory, **settings)`` of ``trial_file`` in a new interpreter.

    ``tree`` goes first on ``sys.path``, so its ``tokcap``, ``transports`` and ``bench`` are the ones measured;
    the trial file itself is read from this checkout, so a tree older than the file can still be measured.
    """

    async def run(directory: Path) -> Mapping[str, float]:
        code = (
            "import asyncio, json, runpy, sys; from pathlib import Path; "
            f"sys.path.insert(0, {str(tree)!r}); "
            f"trial = runpy.run_path({str(trial_file)!r})[{function!r}]; "
            f"print(json.dumps(asyncio.run(trial(Path({str(directory)!r}), **{dict(settings)!r}))))"
        )
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"trial of {tree} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
        return figures

    return run


def _proc_field(path: str, prefix: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _filesystem(directory: Path) -> str:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    resolved = str(directory.resolve())
    best, found = "", "unknown"
    for line in mounts:
        device, mount, kind = line.split()[:3]
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, found = mount, f"{kind} on {device} (mounted at {mount})"
    return found


def machine_description(directory: Path) -> dict[str, Any]:
    """Where the numbers come from: CPU, cores, memory, Python and the filesystem of the trial directories."""
    memory = _proc_field("/proc/meminfo", "MemTotal:")
    return {
        "cpu": _proc_field("/proc/cpuinfo", "model name") or "unknown",
        "cores": os.cpu_count(),
        "memory_gb": round(int(memory.split()[0]) / 1024 / 1024, 1) if memory else 0.0,
        "python": platform.python_version(),
        "platform": f"{os.uname().sysname} {os.uname().release} {os.uname().machine}",
        "filesystem": _filesystem(directory),
    }


def machine_line(machine: Mapping[str, Any]) -> str:
    """The machine in one line, printed above every comparison and written beside its results."""
    return (
        f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gb']} GB, Python {machine['python']}, "
        f"{machine['filesystem']}"
    )

"""Progress bars on stderr, drawn only for a person at a terminal."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokcap.cli.console import progress_console

__all__ = ["demo_progress", "make_progress"]


def make_progress(enabled: bool = True) -> Progress:
    """A progress display on stderr; disabled when asked or when stderr is not a terminal."""
    console = progress_console()
    return Progress(
        TextColumn("{task.description:<12}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not enabled or not console.is_terminal,
    )


@contextmanager
def demo_progress(rollouts: int, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """Yield the demo's progress callback: one bar for capture, one for finalize."""
    with make_progress(enabled) as progress:
        tasks = {
            "captured": progress.add_task("capturing", total=rollouts),
            "finalized": progress.add_task("finalizing", total=rollouts),
        }

        def advance(phase: str) -> None:
            progress.advance(tasks[phase])

        yield advance

"""A run's results as Markdown, and the marked section of ``bench/README.md`` they replace (``--update-readme``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.harness import machine_line
from bench.report import sections

__all__ = ["README_END", "README_START", "render_markdown", "update_readme"]

README_START = "<!-- bench-results:start -->"
README_END = "<!-- bench-results:end -->"


def _table(headings: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headings) + " |", "|" + "|".join(" --- " for _ in headings) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(results: dict[str, Any]) -> str:
    """Every table of one run, with where and when it ran."""
    command = results.get("command", "python -m bench")
    parts = [
        f"`{command}`, run {results['started_at']} ({results['duration_s']} s), median of "
        f"{results['options']['repeats']} trials per variant. Machine: {machine_line(results['machine'])}; "
        "the broker runs on the same cores. Every table below comes from this one run.",
    ]
    for title, headings, rows in sections(results):
        no = [[cell if cell != "NO" else "**no**" for cell in row] for row in rows]
        parts += ["", f"{title}:", "", _table(headings, no)]
    return "\n".join(parts)


def update_readme(readme: Path, results: dict[str, Any]) -> None:
    """Replace the text between the README's result markers with this run's tables."""
    text = readme.read_text()
    pattern = re.compile(re.escape(README_START) + r".*?" + re.escape(README_END), re.DOTALL)
    if pattern.search(text) is None:
        raise ValueError(f"{readme} has no {README_START} ... {README_END} section to replace")
    replacement = f"{README_START}\n{render_markdown(results)}\n{README_END}"
    readme.write_text(pattern.sub(lambda _: replacement, text))

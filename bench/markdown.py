"""``bench/README.md``'s generated sections: the scenarios and the targets from their tables, a run's results.

Each section sits between marker comments. The scenario and target sections are rendered from
``bench.scenarios`` and ``bench.targets`` (a test keeps the README equal to them); the results section from a
run's results, with the command that produced them (``--update-readme``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.harness import machine_line
from bench.report import sections
from bench.scenarios import SCENARIOS
from bench.targets import ANCHORS, TARGETS

__all__ = [
    "README_END",
    "README_START",
    "render_markdown",
    "render_scenarios",
    "render_targets",
    "replace_section",
    "update_readme",
]

README_START = "<!-- bench-results:start -->"
README_END = "<!-- bench-results:end -->"


def _table(headings: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headings) + " |", "|" + "|".join(" --- " for _ in headings) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render_scenarios() -> str:
    """The scenario table: name, load, variants (the anchor first named), broker, how it runs."""
    rows = []
    for s in SCENARIOS:
        runs = []
        if s.default:
            runs.append("default")
        if s.trial:
            runs.append("fresh process per trial")
        if s.baseline:
            runs.append("needs `--baseline DIR`")
        broker = (
            "needs one"
            if s.kafka
            else ("Kafka columns with one" if s.starts_broker else "only `--bootstrap`")
        )
        variants = ", ".join(f"**{v}**" if v == s.anchor else v for v in s.variants)
        rows.append([f"`{s.name}`", s.load, variants, broker, ", ".join(runs)])
    return _table(["scenario", "load", "variants (**anchor**)", "broker", "runs"], rows)


def render_targets() -> str:
    """The target table: figure, goal, anchor, where in the results it is read."""
    rows = [[t.figure.strip(), t.goal, t.anchor or "", f"`{t.path}`"] for t in TARGETS]
    anchors = "\n".join(f"- `{name}`: {meaning}" for name, meaning in ANCHORS.items())
    return _table(["target", "goal", "anchor", "figure"], rows) + "\n\nAnchors:\n\n" + anchors


def render_markdown(results: dict[str, Any]) -> str:
    """Every table of one run, with the command, where and when it ran."""
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


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with the body between ``<!-- name:start -->`` and ``<!-- name:end -->`` replaced."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text) is None:
        raise ValueError(f"no {start} ... {end} section to replace")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)


def update_readme(readme: Path, results: dict[str, Any]) -> None:
    """Render the scenarios, the targets and this run's results into the README's marked sections."""
    text = readme.read_text()
    text = replace_section(text, "bench-scenarios", render_scenarios())
    text = replace_section(text, "bench-targets", render_targets())
    readme.write_text(replace_section(text, "bench-results", render_markdown(results)))

"""The results as Markdown tables, and the README section they replace (``--update-readme``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.report import GROWTH_COLUMNS, evaluate_targets, growth_rows, main_rows

__all__ = ["README_END", "README_START", "render_markdown", "update_readme"]

README_START = "<!-- bench-results:start -->"
README_END = "<!-- bench-results:end -->"


def _table(headings: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headings) + " |", "|" + "|".join(" --- " for _ in headings) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(results: dict[str, Any]) -> str:
    """The main table, the targets and the growth table of one run, with where and when it ran."""
    main = results["main"]
    shape = main["shape"]
    machine = results["machine"]
    parts = [
        f"Run {results['started_at']} ({results['duration_s']} s), median of {results['options']['repeats']} "
        f"repeats. Machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gb']} GB, "
        f"Python {machine['python']}, {machine['filesystem']}; the broker runs on the same cores.",
        "",
        f"Main workload: {shape['rollouts']} concurrent rollouts x {shape['rounds']} rounds, {shape['turns']} "
        f"turns, {shape['prompt_tokens']}-token system prompt, {shape['generated_tokens']} generated and "
        f"{shape['tool_tokens']} tool tokens per turn, seed {shape['seed']}; intent + put per turn, "
        "freeze when a rollout ends.",
        "",
        _table(
            ["figure", "file store", "Kafka (acks=all)", "physical reference"],
            [list(row) for row in main_rows(main["figures"])],
        ),
        "",
        _table(
            ["target", "goal", "measured", "met"],
            [
                [
                    check["target"],
                    check["goal"],
                    "—" if check["value"] is None else f"{check['value']:,.2f}",
                    "—" if check["met"] is None else ("yes" if check["met"] else "**no**"),
                ]
                for check in evaluate_targets(main["figures"])
            ],
        ),
    ]
    if results["growth"]:
        parts += [
            "",
            f"Growth ({results['options']['growth_rollouts']} concurrent rollouts x {shape['rounds']} rounds, "
            "same per-turn tokens):",
            "",
            _table([heading for heading, _, _ in GROWTH_COLUMNS], growth_rows(results["growth"])),
        ]
    return "\n".join(parts)


def update_readme(readme: Path, results: dict[str, Any]) -> None:
    """Replace the text between the README's result markers with this run's tables."""
    text = readme.read_text()
    pattern = re.compile(re.escape(README_START) + r".*?" + re.escape(README_END), re.DOTALL)
    if pattern.search(text) is None:
        raise ValueError(f"{readme} has no {README_START} ... {README_END} section to replace")
    replacement = f"{README_START}\n{render_markdown(results)}\n{README_END}"
    readme.write_text(pattern.sub(lambda _: replacement, text))

"""Which committed call ends a rollout, when the harness did not say: Gym 0.7.0's parent-link walk.

Roots with children beat childless roots; among roots the earliest admitted wins (unstamped rows last,
then manifest order). From there each level keeps the children that have children of their own (or all,
when none do); exactly one must remain, else the terminal is ambiguous and nothing is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TerminalSelection", "select_terminal_call"]


@dataclass(frozen=True)
class TerminalSelection:
    """The chosen terminal call, or ``None`` with the reason (Gym's reason codes)."""

    terminal_model_call_id: str | None
    reason: str


def select_terminal_call(records: Sequence[Any]) -> TerminalSelection:
    """Pick the terminal call from parent links; ``reason`` is ``selected`` or why none could be."""
    if not records:
        return TerminalSelection(None, "no_records")
    by_id = {record.model_call_id: record for record in records}
    if len(by_id) != len(records):
        return TerminalSelection(None, "duplicate_call_id")
    if any(record.parent_call_id is not None and record.parent_call_id not in by_id for record in records):
        return TerminalSelection(None, "orphaned_row")
    children: dict[str, list[Any]] = {}
    roots = []
    for record in records:
        if record.parent_call_id is None:
            roots.append(record)
        else:
            children.setdefault(record.parent_call_id, []).append(record)
    if not roots:
        return TerminalSelection(None, "no_root")
    position = {record.model_call_id: index for index, record in enumerate(records)}

    def order(record: Any) -> tuple[bool, float, int]:
        stamped = record.admitted_at
        return (stamped is None, stamped if stamped is not None else 0.0, position[record.model_call_id])

    def extended(candidates: list[Any]) -> list[Any]:
        return [record for record in candidates if children.get(record.model_call_id)] or candidates

    node = min(extended(roots), key=order)
    while True:
        candidates = children.get(node.model_call_id) or []
        if not candidates:
            return TerminalSelection(node.model_call_id, "selected")
        pool = extended(candidates)
        if len(pool) > 1:
            return TerminalSelection(None, "ambiguous_terminal")
        node = pool[0]

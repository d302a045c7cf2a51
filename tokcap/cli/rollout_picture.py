"""A picture of one rollout: its calls as a tree by parent link, the terminal chain, and why it was masked.

A person debugging a masked rollout would otherwise read JSON lines; a drawing shows at a glance which call
broke and why. The caller describes the rollout as plain data (``RolloutPicture``), built from whatever it
read; this module only lays it out and writes SVG, or a standalone HTML page around the same SVG.

Every string comes from untrusted input (call ids, reasons that quote message content), so all text is
escaped and characters XML cannot hold are replaced. The layout is a top-down tree: depth is the row, each
leaf takes the next column, a parent sits above its first child, and the terminal chain's child comes first,
so the delivered chain runs straight down the left. Nothing recurses, so a chain of any depth draws.
"""

from __future__ import annotations

import html
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal
from xml.sax.saxutils import escape, quoteattr

__all__ = ["Outcome", "PictureCall", "RolloutPicture", "render_html", "render_svg"]

Outcome = Literal["delivered", "masked", "retired"]
"""What became of the rollout: trained on, masked (zero loss weight), or already retired (nothing left)."""

_NOT_CAPTURED_PARENT = "named as a parent but never captured"
"""The mark of a box drawn for a parent id that no call of the picture has."""

_CYCLE = "its parent link forms a cycle; drawn as a root"
"""The note of a call whose parent chain loops back to itself."""


@dataclass(frozen=True)
class PictureCall:
    """One model call as drawn: its parent link, token counts, and what is wrong with it.

    ``captured`` is false for a call known only from an intent, a failure row or a child's parent link.
    ``marks`` say why this call masks the rollout or cannot be used (drawn in red); ``notes`` say what else
    is known and harmless, such as a discarded retry or a cancelled attempt (drawn in grey).
    ``prompt_label`` names the prompt count: a staged row's prompt is the delta since its parent.
    """

    call_id: str
    parent_id: str | None = None
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    weight_version: int | None = None
    captured: bool = True
    marks: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    prompt_label: str = "prompt"


@dataclass(frozen=True)
class RolloutPicture:
    """Everything drawn for one rollout.

    ``terminal_chain`` lists the delivered (or, for a masked rollout, the would-be) chain from root to the
    terminal call. ``reasons`` are the verdict's mask reasons; ``notes`` are findings that belong to no one
    call (a dead letter without a call id, a verifier failure). ``summary`` is one line of state.
    """

    rollout_id: str
    outcome: Outcome
    reasons: tuple[str, ...] = ()
    calls: tuple[PictureCall, ...] = ()
    terminal_chain: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    summary: str = ""


# Geometry, in pixels. Text is monospace, so its width follows from its length.
_FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
_SIZE = 12
_CHAR = 7.3
_LINE = 16
_HEAD_SIZE = 15
_HEAD_CHAR = 9.1
_HEAD_LINE = 21
_PAD = 9
_MARGIN = 20
_COL_GAP = 28
_ROW_GAP = 34
_MIN_BOX = 260
_MAX_BOX = 330
_MIN_WIDTH = 640
_MARK_LINES = 3
"""Lines one mark may take inside a box; the full text is in the box's tooltip and the HTML page."""

_GREEN, _GREEN_FILL = "#1a7f37", "#dafbe1"
_BLUE, _BLUE_FILL = "#0969da", "#ddf4ff"
_RED, _RED_FILL = "#cf222e", "#ffebe9"
_GREY, _GREY_FILL = "#6e7781", "#f6f8fa"
_INK, _MUTED = "#1f2328", "#57606a"

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_safe(text: str) -> str:
    """``text`` with every character XML 1.0 cannot hold (NUL, most controls, lone surrogates) as U+FFFD."""
    return _NOT_XML.sub("\ufffd", text)


def _clean(text: str) -> str:
    """Text XML can hold, on one line: characters it cannot hold become U+FFFD, whitespace a space."""
    return " ".join(_xml_safe(text).split())


def _fit(text: str, chars: int) -> str:
    """``text`` cut to ``chars`` characters, with an ellipsis when something was cut."""
    return text if len(text) <= chars else text[: max(chars - 1, 0)] + "\u2026"


def _wrap(text: str, chars: int, lines: int) -> list[str]:
    """``text`` in at most ``lines`` lines of ``chars`` characters, the last ending in an ellipsis if cut."""
    wrapped = textwrap.wrap(text, width=chars) or [""]
    if len(wrapped) > lines:
        wrapped = wrapped[:lines]
        wrapped[-1] = wrapped[-1][: chars - 1] + "\u2026"
    return wrapped


def _merged(calls: Iterable[PictureCall]) -> dict[str, PictureCall]:
    """One call per id, in first-seen order; a repeated id adds its marks and notes to the first."""
    merged: dict[str, PictureCall] = {}
    for call in calls:
        seen = merged.get(call.call_id)
        if seen is None:
            merged[call.call_id] = call
        else:
            merged[call.call_id] = replace(
                seen,
                marks=tuple(dict.fromkeys((*seen.marks, *call.marks))),
                notes=tuple(dict.fromkeys((*seen.notes, *call.notes))),
            )
    for call in list(merged.values()):
        if call.parent_id is not None and call.parent_id not in merged:
            merged[call.parent_id] = PictureCall(
                call.parent_id, captured=False, marks=(_NOT_CAPTURED_PARENT,)
            )
    return merged


@dataclass
class _Node:
    call: PictureCall
    lines: list[tuple[str, str]] = field(default_factory=list)
    depth: int = 0
    column: int = 0
    parent: str | None = None


def _counts(call: PictureCall) -> str:
    """The token counts line of a box, or that the call was never captured."""
    if not call.captured:
        return "not captured"
    prompt = "?" if call.prompt_tokens is None else f"{call.prompt_tokens:,}"
    generated = "?" if call.generated_tokens is None else f"{call.generated_tokens:,}"
    return f"{_clean(call.prompt_label)} {prompt} \u00b7 gen {generated}"


def _box_lines(call: PictureCall, chars: int) -> list[tuple[str, str]]:
    """The lines of one box with their kind (``id``, ``count``, ``mark``, ``note``), fitted to ``chars``."""
    lines: list[tuple[str, str]] = [
        ("id", _fit(_clean(call.call_id), chars)),
        ("count", _fit(_counts(call), chars)),
    ]
    if call.weight_version is not None:
        lines.append(("count", _fit(f"weight version {call.weight_version}", chars)))
    for mark in call.marks:
        lines.extend(("mark", line) for line in _wrap("\u00d7 " + _clean(mark), chars, _MARK_LINES))
    for note in call.notes:
        lines.extend(("note", line) for line in _wrap(_clean(note), chars, _MARK_LINES))
    return lines


def _box_chars(calls: Iterable[PictureCall]) -> int:
    """Characters per box line: enough for the longest id and counts, within the box width limits."""
    longest = 0
    for call in calls:
        longest = max(longest, len(_clean(call.call_id)), len(_counts(call)))
    width = min(max(longest * _CHAR + 2 * _PAD, _MIN_BOX), _MAX_BOX)
    return int((width - 2 * _PAD) / _CHAR)


def _layout(picture: RolloutPicture, chars: int) -> tuple[dict[str, _Node], list[str]]:
    """Place every call: depth by parent link, a column per leaf; returns the nodes and the drawing order."""
    calls = _merged(picture.calls)
    on_chain = set(picture.terminal_chain)
    children: dict[str, list[str]] = {}
    for call in calls.values():
        if call.parent_id is not None and call.parent_id != call.call_id:
            children.setdefault(call.parent_id, []).append(call.call_id)
    for siblings in children.values():
        siblings.sort(key=lambda call_id: call_id not in on_chain)
    for call_id, call in calls.items():
        if call.parent_id == call_id:
            calls[call_id] = replace(call, parent_id=None, notes=(*call.notes, _CYCLE))
    roots = [call_id for call_id, call in calls.items() if call.parent_id is None]
    roots.sort(key=lambda call_id: call_id not in on_chain)
    nodes: dict[str, _Node] = {}
    order: list[str] = []
    next_column = 0
    while len(nodes) < len(calls):
        if not roots:
            # Every call left sits on a parent-link cycle: break it at the first one.
            first = next(call_id for call_id in calls if call_id not in nodes)
            call = calls[first]
            calls[first] = replace(call, parent_id=None, notes=(*call.notes, _CYCLE))
            roots = [first]
        stack: list[tuple[str, int, str | None]] = [(root, 0, None) for root in reversed(roots)]
        roots = []
        while stack:
            call_id, depth, parent = stack.pop()
            if call_id in nodes:
                continue
            kids = [kid for kid in children.get(call_id, []) if kid not in nodes]
            node = _Node(calls[call_id], _box_lines(calls[call_id], chars), depth, next_column, parent)
            nodes[call_id] = node
            order.append(call_id)
            if not kids:
                next_column += 1
            stack.extend((kid, depth + 1, call_id) for kid in reversed(kids))
    return nodes, order


def _box_height(node: _Node) -> float:
    """A box's height in pixels: its lines and padding."""
    return len(node.lines) * _LINE + 2 * _PAD - 4.0


def _header_lines(picture: RolloutPicture, width: float) -> list[tuple[str, str]]:
    """The title, the verdict, the summary and the rollout-wide notes, wrapped to ``width`` pixels."""
    title = _fit("rollout " + _clean(picture.rollout_id), int(width / _HEAD_CHAR))
    chars = int(width / _CHAR)
    lines: list[tuple[str, str]] = [("title", title)]
    verdict = {"delivered": "delivered", "masked": "masked", "retired": "retired (records removed)"}[
        picture.outcome
    ]
    if picture.reasons:
        verdict += ": " + ", ".join(_clean(reason) for reason in picture.reasons)
    lines.extend(("verdict", line) for line in _wrap(verdict, chars, 4))
    if picture.summary:
        lines.extend(("summary", line) for line in _wrap(_clean(picture.summary), chars, 2))
    for note in picture.notes:
        lines.extend(("mark", line) for line in _wrap("\u00d7 " + _clean(note), chars, _MARK_LINES))
    if picture.terminal_chain:
        chain = " \u2192 ".join(_clean(call_id) for call_id in picture.terminal_chain)
        lines.extend(("summary", line) for line in _wrap(f"{_chain_label(picture)}: {chain}", chars, 2))
    return lines


def _chain_colours(picture: RolloutPicture) -> tuple[str, str]:
    """Green for a chain that was delivered; blue for the chain a masked rollout would have delivered."""
    return (_GREEN, _GREEN_FILL) if picture.outcome == "delivered" else (_BLUE, _BLUE_FILL)


def _chain_label(picture: RolloutPicture) -> str:
    """What the highlighted chain is: delivered, or what a masked rollout would have delivered."""
    return "terminal chain" if picture.outcome == "delivered" else "chain it would deliver"


def _box_style(call: PictureCall, on_chain: bool, chain: tuple[str, str]) -> tuple[str, str, str, str]:
    """Stroke, fill, stroke width and dash pattern of a box."""
    dash = "" if call.captured else "6 4"
    if on_chain:
        return (_RED if call.marks else chain[0], chain[1], "3", dash)
    if call.marks:
        return (_RED, _RED_FILL, "2", dash)
    return (_GREY, _GREY_FILL, "1.5", dash)


_TEXT_STYLE = {
    "id": f'font-weight="bold" fill="{_INK}"',
    "count": f'fill="{_MUTED}"',
    "mark": f'fill="{_RED}"',
    "note": f'fill="{_MUTED}" font-style="italic"',
    "title": f'font-weight="bold" fill="{_INK}"',
    "summary": f'fill="{_MUTED}"',
}


def _tooltip(call: PictureCall) -> str:
    """Everything known about a call, uncut, for the box's ``<title>``."""
    parts = [call.call_id, *call.marks, *call.notes]
    return "\n".join(_xml_safe(part) for part in parts)


def _legend_items(picture: RolloutPicture) -> list[tuple[str, str, str, str, str]]:
    """Label, stroke, fill, stroke width and dash pattern of each style the key explains."""
    stroke, fill = _chain_colours(picture)
    chain = [(_chain_label(picture), stroke, fill, "3", "")] if picture.terminal_chain else []
    return [
        *chain,
        ("masked or unusable", _RED, _RED_FILL, "2", ""),
        ("not captured (dashed)", _GREY, "#ffffff", "1.5", "6 4"),
        ("not delivered", _GREY, _GREY_FILL, "1.5", ""),
    ]


def _legend(picture: RolloutPicture, y: float) -> tuple[list[str], float]:
    """A one-row key of the box styles at height ``y``; returns its elements and its height."""
    items = _legend_items(picture)
    parts: list[str] = []
    x = float(_MARGIN)
    for label, stroke, fill, width, dash in items:
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="26" height="14" rx="3" fill="{fill}" stroke="{stroke}" '
            f'stroke-width="{width}"{dash_attr}/>'
        )
        parts.append(f'<text x="{x + 34:.1f}" y="{y + 11.5:.1f}" fill="{_MUTED}">{escape(label)}</text>')
        x += 34 + len(label) * _CHAR + 24
    return parts, 14.0


def _legend_width(picture: RolloutPicture) -> float:
    """The width the key's one row needs."""
    return _MARGIN + sum(34 + len(item[0]) * _CHAR + 24 for item in _legend_items(picture))


def render_svg(picture: RolloutPicture) -> str:
    """The picture as a standalone SVG document (no XML declaration, so it also embeds in HTML)."""
    chars = _box_chars(picture.calls)
    box_width = chars * _CHAR + 2 * _PAD
    nodes, order = _layout(picture, chars)
    columns = max((node.column for node in nodes.values()), default=-1) + 1
    tree_width = columns * box_width + max(columns - 1, 0) * _COL_GAP
    width = max(_MIN_WIDTH, tree_width + 2 * _MARGIN, _legend_width(picture))
    header = _header_lines(picture, width - 2 * _MARGIN)
    on_chain = set(picture.terminal_chain)
    chain_edges = set(zip(picture.terminal_chain, picture.terminal_chain[1:], strict=False))
    chain_colours = _chain_colours(picture)

    parts: list[str] = []
    y = float(_MARGIN + _HEAD_SIZE)
    for kind, line in header:
        style = _TEXT_STYLE.get(kind, "")
        if kind == "verdict":
            colour = {"delivered": _GREEN, "masked": _RED}.get(picture.outcome, _MUTED)
            style = f'font-weight="bold" fill="{colour}"'
        size = f' font-size="{_HEAD_SIZE}"' if kind == "title" else ""
        parts.append(f'<text x="{_MARGIN}" y="{y:.1f}"{size} {style}>{escape(line)}</text>')
        y += _HEAD_LINE if kind == "title" else _LINE + 2
    top = y + 10

    rows: dict[int, float] = {}
    for node in nodes.values():
        rows[node.depth] = max(rows.get(node.depth, 0.0), _box_height(node))
    row_top: dict[int, float] = {}
    cursor = top
    for depth in range(len(rows)):
        row_top[depth] = cursor
        cursor += rows[depth] + _ROW_GAP
    tree_bottom = cursor - _ROW_GAP if rows else top

    def box_x(node: _Node) -> float:
        return _MARGIN + node.column * (box_width + _COL_GAP)

    edges: list[str] = []
    for call_id in order:
        node = nodes[call_id]
        if node.parent is None:
            continue
        parent = nodes[node.parent]
        x1 = box_x(parent) + box_width / 2
        y1 = row_top[parent.depth] + _box_height(parent)
        x2 = box_x(node) + box_width / 2
        y2 = row_top[node.depth] - 2
        bend = (y2 - y1) / 2
        chain_edge = (node.parent, call_id) in chain_edges
        colour, stroke = (chain_colours[0], "3") if chain_edge else (_GREY, "1.5")
        dash = "" if node.call.captured else ' stroke-dasharray="6 4"'
        marker = "chain" if chain_edge else "edge"
        edges.append(
            f'<path class="edge" d="M {x1:.1f} {y1:.1f} C {x1:.1f} {y1 + bend:.1f} {x2:.1f} {y2 - bend:.1f} '
            f'{x2:.1f} {y2:.1f}" fill="none" stroke="{colour}" stroke-width="{stroke}"{dash} '
            f'marker-end="url(#{marker})"/>'
        )

    boxes: list[str] = []
    for call_id in order:
        node = nodes[call_id]
        x, box_top = box_x(node), row_top[node.depth]
        stroke, fill, stroke_width, dash = _box_style(node.call, call_id in on_chain, chain_colours)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        terminal = "true" if call_id in on_chain else "false"
        parent_attr = "" if node.parent is None else f" data-parent-id={quoteattr(_xml_safe(node.parent))}"
        boxes.append(
            f'<g class="call" data-call-id={quoteattr(_xml_safe(call_id))}{parent_attr} data-terminal="{terminal}">'
        )
        boxes.append(f"<title>{escape(_tooltip(node.call))}</title>")
        boxes.append(
            f'<rect x="{x:.1f}" y="{box_top:.1f}" width="{box_width:.1f}" height="{_box_height(node):.1f}" '
            f'rx="6" fill="{fill}" stroke="{stroke}" stroke-width="{stroke_width}"{dash_attr}/>'
        )
        for index, (kind, line) in enumerate(node.lines):
            baseline = box_top + _PAD + index * _LINE + _SIZE - 1
            boxes.append(
                f'<text x="{x + _PAD:.1f}" y="{baseline:.1f}" {_TEXT_STYLE[kind]}>{escape(line)}</text>'
            )
        boxes.append("</g>")

    legend, legend_height = _legend(picture, tree_bottom + 24) if nodes else ([], -24.0)
    canvas_height = tree_bottom + 24 + legend_height + _MARGIN
    defs = (
        "<defs>"
        f'<marker id="edge" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="{_GREY}"/></marker>'
        f'<marker id="chain" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="5" markerHeight="5" '
        f'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="{chain_colours[0]}"/></marker>'
        "</defs>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{canvas_height:.0f}" '
        f'viewBox="0 0 {width:.0f} {canvas_height:.0f}" font-family="{_FONT}" font-size="{_SIZE}">'
        f'<rect width="100%" height="100%" fill="#ffffff"/>{defs}'
        + "".join(parts)
        + "".join(edges)
        + "".join(boxes)
        + "".join(legend)
        + "</svg>\n"
    )


_CHAIN_TEXT = {
    "terminal chain": "green boxes and arrows: the chain delivered to training, root to terminal call",
    "chain it would deliver": "blue boxes and arrows: the chain training would get were the rollout not masked",
}

_LEGEND_TEXT = (
    ("masked or unusable", "red box: the call masks the rollout or cannot be used; the reason is in red"),
    ("not captured", "dashed box: known only from an intent, a failure row or a child's parent link"),
    ("not delivered", "grey box: captured, but not on the delivered chain (a branch or a discarded retry)"),
    ("arrows", "parent call \u2192 child call, by the parent link each call records"),
)


def _html_list(items: Sequence[str]) -> str:
    """An HTML list of untrusted strings, escaped."""
    return "<ul>" + "".join(f"<li>{html.escape(_xml_safe(item))}</li>" for item in items) + "</ul>"


def render_html(picture: RolloutPicture) -> str:
    """A standalone HTML page: the SVG, a legend, and every reason in full (boxes cut long ones).

    The SVG carries the title and verdict; wide pictures scroll on screen and shrink to the page in print.
    """
    title = html.escape(_clean(picture.rollout_id))
    findings = [*picture.notes]
    for call in _merged(picture.calls).values():
        findings.extend(f"call {call.call_id}: {mark}" for mark in call.marks)
    chain = _chain_label(picture)
    explained = [(chain, _CHAIN_TEXT[chain])] if picture.terminal_chain else []
    legend = "".join(
        f"<dt>{html.escape(name)}</dt><dd>{html.escape(text)}</dd>"
        for name, text in (*explained, *_LEGEND_TEXT)
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f"<title>tokcap rollout {title}</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:24px;color:#1f2328}"
        "figure{margin:0;overflow-x:auto}dt{font-weight:bold;margin-top:6px}dd{margin-left:16px}"
        "li{font-family:monospace;white-space:pre-wrap;overflow-wrap:anywhere}"
        "@media print{figure svg{max-width:100%;height:auto}}</style></head><body>"
        f"<figure>{render_svg(picture)}</figure>"
        f"<h2>Legend</h2><dl>{legend}</dl>"
        + (f"<h2>Why</h2>{_html_list(findings)}" if findings else "")
        + "</body></html>\n"
    )

"""The picture of a rollout draws every call once, highlights exactly its terminal chain, says why it is masked,
never lets a box overlap another or text leave its box, and escapes every string it was given."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from html.parser import HTMLParser

from tokcap.cli.rollout_picture import PictureCall, RolloutPicture, render_html, render_svg

_SVG = "{http://www.w3.org/2000/svg}"
_CHAR_WIDTH = 7.3
"""Advance of one character of the picture's 12 px monospace font (DejaVu Sans Mono: 0.602 em), rounded up."""


@dataclass(frozen=True)
class Box:
    call_id: str
    parent_id: str | None
    terminal: bool
    x: float
    y: float
    width: float
    height: float
    stroke: str
    dashed: bool
    lines: list[str]
    title: str


def _boxes(svg: str) -> dict[str, Box]:
    """Each call's box as drawn, parsed back from the SVG (which must be well-formed XML)."""
    root = ET.fromstring(svg)
    boxes: dict[str, Box] = {}
    for group in root.iter(f"{_SVG}g"):
        if group.get("class") != "call":
            continue
        rect = group.find(f"{_SVG}rect")
        title = group.find(f"{_SVG}title")
        assert rect is not None and title is not None
        call_id = group.get("data-call-id")
        assert call_id is not None and call_id not in boxes, f"call {call_id!r} drawn twice"
        boxes[call_id] = Box(
            call_id=call_id,
            parent_id=group.get("data-parent-id"),
            terminal=group.get("data-terminal") == "true",
            x=float(rect.get("x", "0")),
            y=float(rect.get("y", "0")),
            width=float(rect.get("width", "0")),
            height=float(rect.get("height", "0")),
            stroke=rect.get("stroke", ""),
            dashed=rect.get("stroke-dasharray") is not None,
            lines=[text.text or "" for text in group.iter(f"{_SVG}text")],
            title=title.text or "",
        )
    return boxes


def _all_text(svg: str) -> list[str]:
    return [text.text or "" for text in ET.fromstring(svg).iter(f"{_SVG}text")]


def _assert_readable(svg: str) -> dict[str, Box]:
    """No two boxes overlap, every line fits inside its box, and the canvas holds every box."""
    root = ET.fromstring(svg)
    width, height = float(root.get("width", "0")), float(root.get("height", "0"))
    boxes = _boxes(svg)
    placed = list(boxes.values())
    for index, box in enumerate(placed):
        assert box.x >= 0 and box.y >= 0 and box.x + box.width <= width and box.y + box.height <= height
        for line in box.lines:
            assert len(line) * _CHAR_WIDTH <= box.width - 2 * 8, (
                f"{line!r} overflows the box of {box.call_id!r}"
            )
        for other in placed[index + 1 :]:
            apart = (
                box.x + box.width <= other.x
                or other.x + other.width <= box.x
                or box.y + box.height <= other.y
                or other.y + other.height <= box.y
            )
            assert apart, f"boxes of {box.call_id!r} and {other.call_id!r} overlap"
    return boxes


def _chain_edges(svg: str, colour: str) -> int:
    return sum(
        1
        for path in ET.fromstring(svg).iter(f"{_SVG}path")
        if path.get("class") == "edge" and path.get("stroke") == colour
    )


def _linear(n: int, outcome: str = "delivered") -> RolloutPicture:
    calls = tuple(
        PictureCall(f"turn-{i}", None if i == 0 else f"turn-{i - 1}", 100 + 50 * i, 20) for i in range(n)
    )
    return RolloutPicture(
        "r-linear",
        "delivered" if outcome == "delivered" else "masked",
        calls=calls,
        terminal_chain=tuple(call.call_id for call in calls),
    )


def test_a_linear_chain_is_one_column_of_highlighted_boxes_joined_by_highlighted_arrows() -> None:
    svg = render_svg(_linear(4))
    boxes = _assert_readable(svg)
    assert list(boxes) == ["turn-0", "turn-1", "turn-2", "turn-3"]
    assert all(box.terminal and box.stroke == "#1a7f37" for box in boxes.values())
    assert len({box.x for box in boxes.values()}) == 1
    assert [box.y for box in boxes.values()] == sorted(box.y for box in boxes.values())
    assert _chain_edges(svg, "#1a7f37") == 3
    assert "prompt 250 \u00b7 gen 20" in boxes["turn-3"].lines
    assert "delivered" in _all_text(svg)


def test_a_branching_tree_highlights_only_the_terminal_chain_and_greys_the_abandoned_branch() -> None:
    picture = RolloutPicture(
        "r-tree",
        "delivered",
        calls=(
            PictureCall("root", None, 100, 20),
            PictureCall("side", "root", 130, 30, notes=("discarded retry",)),
            PictureCall("side-child", "side", 200, 5),
            PictureCall("kept", "root", 130, 15),
            PictureCall("kept-end", "kept", 160, 12),
        ),
        terminal_chain=("root", "kept", "kept-end"),
    )
    svg = render_svg(picture)
    boxes = _assert_readable(svg)
    assert {call_id for call_id, box in boxes.items() if box.terminal} == {"root", "kept", "kept-end"}
    assert {call_id: box.parent_id for call_id, box in boxes.items()} == {
        "root": None,
        "side": "root",
        "side-child": "side",
        "kept": "root",
        "kept-end": "kept",
    }
    assert boxes["side"].stroke == boxes["side-child"].stroke == "#6e7781"
    assert "discarded retry" in boxes["side"].lines
    # The terminal chain runs straight down the left; the abandoned branch sits beside it.
    assert boxes["root"].x == boxes["kept"].x == boxes["kept-end"].x < boxes["side"].x
    assert boxes["side"].y == boxes["kept"].y and boxes["side-child"].y == boxes["kept-end"].y
    assert _chain_edges(svg, "#1a7f37") == 2


def test_a_masked_rollout_marks_its_dangling_intent_and_says_why_in_the_header() -> None:
    picture = RolloutPicture(
        "r-masked",
        "masked",
        reasons=("incomplete",),
        calls=(
            PictureCall("turn-0", None, 512, 62),
            PictureCall("turn-1-retry", "turn-0", 681, 59),
            PictureCall(
                "turn-1-lost", captured=False, marks=("intent without entry: dispatched, never captured",)
            ),
        ),
        terminal_chain=("turn-0", "turn-1-retry"),
        notes=("incomplete: dead-lettered event at p0 @12: undecodable",),
    )
    svg = render_svg(picture)
    boxes = _assert_readable(svg)
    lost = boxes["turn-1-lost"]
    assert lost.dashed and lost.stroke == "#cf222e" and not lost.terminal
    assert "not captured" in lost.lines
    assert any("intent without entry" in line for line in lost.lines)
    text = _all_text(svg)
    assert "masked: incomplete" in text
    assert any("dead-lettered event at p0 @12" in line for line in text)
    # A masked rollout delivers nothing: its would-be chain is drawn, but not in the delivered colour.
    assert boxes["turn-0"].terminal and boxes["turn-0"].stroke == "#0969da"
    assert _chain_edges(svg, "#1a7f37") == 0 and _chain_edges(svg, "#0969da") == 1


def test_a_staged_rollout_shows_delta_prompts_weight_versions_and_a_failure_row_without_a_staged_call() -> (
    None
):
    picture = RolloutPicture(
        "r-staged",
        "masked",
        reasons=("capture_failed (call call-2)",),
        calls=(
            PictureCall("call-0", None, 512, 93, weight_version=4, prompt_label="delta prompt"),
            PictureCall("call-1", "call-0", 54, 40, weight_version=4, prompt_label="delta prompt"),
            PictureCall("call-3", "call-2", 93, 92, weight_version=5, prompt_label="delta prompt"),
            PictureCall("call-2", captured=False, marks=("ledger failure: capture_failed",)),
        ),
    )
    svg = render_svg(picture)
    boxes = _assert_readable(svg)
    assert boxes["call-1"].lines[1:3] == ["delta prompt 54 \u00b7 gen 40", "weight version 4"]
    assert "weight version 5" in boxes["call-3"].lines
    assert boxes["call-2"].dashed and "\u00d7 ledger failure: capture_failed" in " ".join(
        boxes["call-2"].lines
    )
    assert boxes["call-3"].y > boxes["call-2"].y
    assert not any(box.terminal for box in boxes.values())


def test_a_parent_no_call_has_gets_a_dashed_box_and_a_parent_cycle_still_draws_every_call_once() -> None:
    picture = RolloutPicture(
        "r-odd",
        "masked",
        calls=(
            PictureCall("orphan", "ghost", 3, 3),
            PictureCall("loop-a", "loop-b", 1, 1),
            PictureCall("loop-b", "loop-a", 1, 1),
            PictureCall("self", "self", 1, 1),
            PictureCall("twice", None, 1, 1, marks=("first",)),
            PictureCall("twice", None, 1, 1, marks=("second",)),
        ),
    )
    boxes = _assert_readable(render_svg(picture))
    assert set(boxes) == {"orphan", "ghost", "loop-a", "loop-b", "self", "twice"}
    assert boxes["ghost"].dashed and boxes["ghost"].y < boxes["orphan"].y
    assert any("cycle" in line for line in boxes["loop-a"].lines + boxes["loop-b"].lines)
    assert any("cycle" in line for line in boxes["self"].lines)
    assert "\u00d7 first" in boxes["twice"].lines and "\u00d7 second" in boxes["twice"].lines


def test_hostile_call_ids_and_reasons_are_escaped_in_the_svg_and_the_html_page() -> None:
    script = '<script>alert("x")</script>'
    picture = RolloutPicture(
        script,
        "masked",
        reasons=('"&', "<b>bold</b>"),
        calls=(
            PictureCall(script, None, 5, 5),
            PictureCall('"&amp;\x00\x1b', script, 9, 3, marks=("<img src=x onerror=alert(1)>",)),
        ),
        notes=("]]><!-- & -->",),
    )
    svg = render_svg(picture)
    page = render_html(picture)
    for document in (svg, page):
        assert "<script>" not in document and "<img" not in document and "<b>" not in document
    boxes = _boxes(svg)
    # The strings come back unchanged once parsed, except characters XML cannot hold.
    assert set(boxes) == {script, '"&amp;\ufffd\ufffd'}
    assert script in boxes[script].lines
    assert boxes['"&amp;\ufffd\ufffd'].parent_id == script
    assert "\u00d7 <img src=x onerror=alert(1)>" in " ".join(boxes['"&amp;\ufffd\ufffd'].lines)
    assert 'masked: "&, <b>bold</b>' in _all_text(svg)

    tags: list[str] = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            tags.append(tag)

    Tags().feed(page)
    assert "script" not in tags and "img" not in tags and "b" not in tags
    assert tags.count("svg") == 1


def test_long_ids_and_reasons_are_cut_to_fit_their_box_and_kept_whole_in_the_tooltip_and_the_page() -> None:
    long_id = "call-" + "0123456789abcdef" * 8
    reason = "dead-lettered event at p0 @12: " + "y" * 600
    picture = RolloutPicture("r-long", "masked", calls=(PictureCall(long_id, None, 1, 1, marks=(reason,)),))
    svg = render_svg(picture)
    box = _assert_readable(svg)[long_id]
    assert box.lines[0].endswith("\u2026") and box.lines[0][:-1] in long_id
    assert box.lines[-1].endswith("\u2026")
    assert box.title == f"{long_id}\n{reason}"
    assert reason in render_html(picture)


def test_token_counts_are_never_cut_however_large() -> None:
    picture = RolloutPicture(
        "r-big",
        "delivered",
        calls=(PictureCall("c", None, 12_345_678, 9_876_543, prompt_label="delta prompt"),),
    )
    box = _assert_readable(render_svg(picture))["c"]
    assert box.lines[1] == "delta prompt 12,345,678 \u00b7 gen 9,876,543"


def test_the_html_page_wraps_the_same_svg_with_a_legend() -> None:
    picture = _linear(3)
    page = render_html(picture)
    assert page.startswith("<!DOCTYPE html>")
    assert render_svg(picture) in page
    assert "<h2>Legend</h2>" in page and "terminal chain" in page


def test_a_chain_of_two_thousand_calls_draws_without_recursion() -> None:
    started = time.perf_counter()
    boxes = _boxes(render_svg(_linear(2000)))
    assert len(boxes) == 2000 and all(box.terminal for box in boxes.values())
    assert time.perf_counter() - started < 5.0

"""The picture of one rollout, built from the description ``tokcap inspect DIR ROLLOUT --json`` prints.

The description already holds the trainer's verdict and chain, so the picture cannot disagree with the
table ``inspect`` prints. Each finding is placed on the call it names; a call known only from an intent,
a failure row or a late event still gets a box, so a dangling call is seen where it is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from tokcap.cli.rollout_picture import Outcome, PictureCall, RolloutPicture, render_html, render_svg

__all__ = ["draw_rollout", "picture_of"]


class _Calls:
    """The calls of a picture in first-seen order, each gathering its marks and notes."""

    def __init__(self) -> None:
        self.calls: dict[str, PictureCall] = {}
        self.marks: dict[str, list[str]] = {}
        self.notes: dict[str, list[str]] = {}
        self._placeholders: set[str] = set()

    def add(self, call: PictureCall) -> None:
        """Keep the first description of a call; one known only by a finding gives way to a real one."""
        if call.call_id not in self.calls or call.call_id in self._placeholders:
            self.calls[call.call_id] = call
            self._placeholders.discard(call.call_id)

    def _known(self, call_id: str) -> None:
        if call_id not in self.calls:
            self.calls[call_id] = PictureCall(call_id, captured=False)
            self._placeholders.add(call_id)

    def mark(self, call_id: str, reason: str) -> None:
        """Say why ``call_id`` masks the rollout or cannot be used."""
        self._known(call_id)
        self.marks.setdefault(call_id, []).append(reason)

    def note(self, call_id: str, text: str) -> None:
        """Say something harmless about ``call_id``."""
        self._known(call_id)
        self.notes.setdefault(call_id, []).append(text)

    def done(self) -> tuple[PictureCall, ...]:
        """Every call with its findings, in first-seen order."""
        return tuple(
            replace(
                call,
                marks=(*call.marks, *self.marks.get(call_id, ())),
                notes=(*call.notes, *self.notes.get(call_id, ())),
            )
            for call_id, call in self.calls.items()
        )


def _entry_calls(detail: Mapping[str, Any], calls: _Calls) -> tuple[str, ...]:
    """Captured entries and what the store and the builder say about them; returns the main chain."""
    build = detail.get("build") or {}
    main = build.get("main_chain") or {}
    chain = tuple(link["model_call_id"] for link in main.get("links", []))
    # Records without lineage are joined by prefix: the builder's chains are the only parent links known.
    chain_parent = {
        call: parent for links in build.get("chain_call_ids", []) for parent, call in pairwise(links)
    }
    for entry in detail["entries"]:
        call_id = entry["model_call_id"]
        lineage = entry.get("parent_resolution") is not None
        calls.add(
            PictureCall(
                call_id,
                entry.get("parent_call_id") if lineage else chain_parent.get(call_id),
                entry.get("full_prompt_tokens") or entry["prompt_tokens"],
                entry["generated_tokens"],
            )
        )
        if entry.get("parent_resolution") == "unresolved":
            why = entry.get("parent_resolution_reason")
            calls.mark(call_id, f"parent unresolved ({why})" if why else "parent unresolved")
    captured = {entry["model_call_id"] for entry in detail["entries"]}
    for call_id, op in detail.get("intents", {}).items():
        if call_id in captured:
            continue
        if op == "intent":
            calls.mark(call_id, "intent without entry: dispatched, never captured")
        else:
            calls.note(call_id, "attempt cancelled")
    lineage_report = detail.get("lineage") or {}
    for call_id in lineage_report.get("digest_mismatches", []):
        calls.mark(call_id, "digest mismatch: its tokens are not what its record committed")
    for call_id in lineage_report.get("unrebuildable", []):
        calls.mark(call_id, "delta prompt cannot be rebuilt from its parent")
    explained = set(calls.marks)
    for call_id in build.get("unresolved_parent_calls", []):
        if call_id not in explained:
            calls.mark(call_id, "parent link not proven: starts a fragment")
    for call_id in build.get("quarantined_call_ids", []):
        calls.mark(call_id, "quarantined: ambiguous parent")
    for call_id in build.get("discarded_retries", []):
        calls.note(call_id, "discarded retry")
    for call_id in build.get("empty_generation_calls", []):
        calls.note(call_id, "no generated tokens: left out")
    return chain


def _staged_calls(detail: Mapping[str, Any], calls: _Calls) -> tuple[str, ...]:
    """Staged rows, ledger rows and failure rows, joined by call id; returns the verified chain."""
    in_ledger = {row["model_call_id"]: row for row in detail.get("ledger", [])}
    failed = {row["model_call_id"] for row in detail.get("ledger_failures", [])}
    for row in detail["staged"]:
        call_id = row.get("model_call_id") or row["staging_key"]
        calls.add(
            PictureCall(
                call_id,
                row.get("parent_call_id"),
                row.get("prompt_tokens"),
                row.get("generated_tokens"),
                row.get("weight_version"),
                prompt_label="delta prompt",
            )
        )
        if call_id not in in_ledger and call_id not in failed:
            calls.note(call_id, "staged, no ledger row: outside the manifest")
    for call_id, row in in_ledger.items():
        if call_id not in calls.calls:
            calls.add(PictureCall(call_id, row.get("parent_call_id"), captured=False))
            calls.mark(call_id, "ledger row names no staged row")
    for row in detail.get("ledger_failures", []):
        calls.mark(row["model_call_id"], f"ledger failure: {row.get('reason') or '(no reason given)'}")
    return tuple(detail.get("staging_chain", []))


def picture_of(detail: Mapping[str, Any]) -> RolloutPicture:
    """The picture of the rollout ``describe_rollout`` described."""
    calls = _Calls()
    staged_only = not detail["entries"] and bool(
        detail.get("staged") or detail.get("ledger") or detail.get("ledger_failures")
    )
    outcome: Outcome
    reasons: tuple[str, ...] = ()
    if staged_only:
        chain = _staged_calls(detail, calls)
        verdict = str(detail.get("staging_verdict") or "")
        outcome = "delivered" if verdict == "trained" else "masked"
        if outcome == "masked":
            reasons = (verdict.removeprefix("masked: "),)
    else:
        chain = _entry_calls(detail, calls)
        verdict_detail = detail.get("verdict")
        if verdict_detail is None:
            return RolloutPicture(
                rollout_id=str(detail["rollout_id"]),
                outcome="retired",
                summary=f"version {detail['version']}; only its fence is kept, so there is nothing to draw",
            )
        if verdict_detail["masked"]:
            outcome, reasons = "masked", tuple(verdict_detail["mask_reasons"])
        else:
            outcome = "delivered"
    notes: list[str] = []
    for mark in detail.get("incomplete_reasons", []):
        reason = mark.get("reason") or "(no reason given)"
        if mark.get("model_call_id"):
            calls.mark(mark["model_call_id"], reason)
        else:
            notes.append(f"incomplete: {reason}")
    for rejection in detail.get("rejections", []):
        what = f"{rejection['event_type']} rejected after the freeze"
        if rejection.get("model_call_id"):
            calls.note(rejection["model_call_id"], what)
        else:
            notes.append(what)
    drawn = calls.done()
    captured = [call for call in drawn if call.captured]
    if staged_only:
        state = "staged engine-side"
    elif detail["state"] == "open":
        state = f"open (judged as if frozen now), version {detail['version']}"
    else:
        state = f"{detail['state']}, version {detail['version']}"
    summary = (
        f"{state}; {len(captured)} calls captured, "
        f"{sum(call.prompt_tokens or 0 for call in captured):,} prompt + "
        f"{sum(call.generated_tokens or 0 for call in captured):,} generated tokens"
    )
    return RolloutPicture(
        rollout_id=str(detail["rollout_id"]),
        outcome=outcome,
        reasons=reasons,
        calls=drawn,
        terminal_chain=chain,
        notes=tuple(notes),
        summary=summary,
    )


def draw_rollout(detail: Mapping[str, Any], *, svg: Path | None, html: Path | None) -> list[Path]:
    """Write the rollout's picture to the files asked for (SVG, HTML page); returns the files written."""
    written: list[Path] = []
    if svg is None and html is None:
        return written
    picture = picture_of(detail)
    if svg is not None:
        svg.write_text(render_svg(picture), encoding="utf-8")
        written.append(svg)
    if html is not None:
        html.write_text(render_html(picture), encoding="utf-8")
        written.append(html)
    return written

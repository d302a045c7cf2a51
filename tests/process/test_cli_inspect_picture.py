"""``tokcap inspect DIR ROLLOUT --svg/--html`` draws what ``inspect`` says: the same chain, verdict and reasons."""

from __future__ import annotations

import asyncio
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import tokcap
from factories import make_entry
from staging_calls import commit_for, conversation

from tokcap.cli.demo import FAULT_FAILED_WRITE, FAULT_LATE_WRITE, FAULT_LOST_CALL, FAULT_RETRY
from tokcap.files.store import TokenCaptureStore
from tokcap.lineage import FileLineageResolver
from tokcap.staging import FileStagingSink

_SVG = "{http://www.w3.org/2000/svg}"


def _calls(svg_path: Path) -> dict[str, tuple[bool, str, list[str]]]:
    """Each drawn call: whether it is on the highlighted chain, its box's stroke, and its lines of text."""
    calls: dict[str, tuple[bool, str, list[str]]] = {}
    for group in ET.parse(svg_path).getroot().iter(f"{_SVG}g"):
        if group.get("class") == "call":
            rect = group.find(f"{_SVG}rect")
            assert rect is not None
            lines = [text.text or "" for text in group.iter(f"{_SVG}text")]
            calls[group.get("data-call-id", "")] = (
                group.get("data-terminal") == "true",
                rect.get("stroke", ""),
                lines,
            )
    return calls


def _header(svg_path: Path) -> list[str]:
    root = ET.parse(svg_path).getroot()
    return [text.text or "" for text in root.findall(f"{_SVG}text")]


def _demo(directory: Path, *extra: str) -> dict[str, Any]:
    completed = tokcap("demo", "--rollouts", "6", "--turns", "3", "--dir", str(directory), "--json", *extra)
    assert completed.returncode == 0, completed.stderr
    report: dict[str, Any] = completed.json()
    return {rollout["fault"]: rollout for rollout in report["rollouts"] if rollout["fault"]}


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("picture") / "store"
    return directory, _demo(directory)


def test_a_masked_demo_rollout_is_drawn_with_its_lost_call_and_the_reason_it_is_masked(
    demo_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory, faults = demo_store
    rollout = faults[FAULT_LOST_CALL]["rollout_id"]
    svg, page = tmp_path / "lost.svg", tmp_path / "lost.html"
    completed = tokcap("inspect", str(directory), rollout, "--svg", str(svg), "--html", str(page))
    assert completed.returncode == 0, completed.stderr
    assert f"picture: {svg}" in completed.stdout and f"picture: {page}" in completed.stdout
    detail = tokcap("inspect", str(directory), rollout, "--json").json()
    calls = _calls(svg)
    chain = [link["model_call_id"] for link in detail["build"]["main_chain"]["links"]]
    assert [call for call, (terminal, _, _) in calls.items() if terminal] == chain
    lost = [call for call, op in detail["intents"].items() if op == "intent" and call not in chain]
    assert lost and all("not captured" in calls[call][2] for call in lost)
    assert all("\u00d7 intent without entry" in " ".join(calls[call][2]) for call in lost)
    assert f"masked: {', '.join(detail['verdict']['mask_reasons'])}" in _header(svg)
    assert page.read_text(encoding="utf-8").count("<svg") == 1


def test_a_failed_write_is_drawn_on_the_call_it_lost_with_the_sinks_reason(
    demo_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory, faults = demo_store
    rollout = faults[FAULT_FAILED_WRITE]["rollout_id"]
    svg = tmp_path / "failed.svg"
    assert tokcap("inspect", str(directory), rollout, "--svg", str(svg)).returncode == 0
    detail = tokcap("inspect", str(directory), rollout, "--json").json()
    calls = _calls(svg)
    for mark in detail["incomplete_reasons"]:
        _, stroke, lines = calls[mark["model_call_id"]]
        assert stroke == "#cf222e" and f"\u00d7 {mark['reason']}" in " ".join(lines)


def test_a_delivered_demo_rollout_is_drawn_with_its_terminal_chain_and_its_late_write(
    demo_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory, faults = demo_store
    rollout = faults[FAULT_LATE_WRITE]["rollout_id"]
    svg = tmp_path / "late.svg"
    completed = tokcap("inspect", str(directory), rollout, "--svg", str(svg), "--json")
    assert completed.returncode == 0, completed.stderr
    detail = completed.json()
    assert detail["verdict"]["masked"] is False
    calls = _calls(svg)
    chain = [link["model_call_id"] for link in detail["build"]["main_chain"]["links"]]
    assert [call for call, (terminal, _, _) in calls.items() if terminal] == chain
    assert all(calls[call][1] == "#1a7f37" for call in chain)
    for entry in detail["entries"]:
        assert (
            f"prompt {entry['prompt_tokens']:,} \u00b7 gen {entry['generated_tokens']:,}"
            in calls[entry["model_call_id"]][2]
        )
    late = {rejection["model_call_id"] for rejection in detail["rejections"]}
    assert late and all("intent rejected after the freeze" in " ".join(calls[call][2]) for call in late)
    assert "delivered" in _header(svg)


def test_a_masked_engine_side_rollout_is_drawn_with_its_failure_row(tmp_path: Path) -> None:
    directory = tmp_path / "staged"
    faults = _demo(directory, "--engine-side")
    rollout = faults[FAULT_LOST_CALL]["rollout_id"]
    svg = tmp_path / "staged.svg"
    assert tokcap("inspect", str(directory), rollout, "--svg", str(svg)).returncode == 0
    detail = tokcap("inspect", str(directory), rollout, "--json").json()
    calls = _calls(svg)
    assert set(calls) == {row["model_call_id"] for row in detail["staged"]} | {
        row["model_call_id"] for row in detail["ledger_failures"]
    }
    for failure in detail["ledger_failures"]:
        assert f"\u00d7 ledger failure: {failure['reason']}" in " ".join(calls[failure["model_call_id"]][2])
    for row in detail["staged"]:
        assert f"weight version {row['weight_version']}" in calls[row["model_call_id"]][2]
    assert not any(terminal for terminal, _, _ in calls.values())
    assert detail["staging_verdict"] in _header(svg)


def test_a_complete_staged_rollout_is_drawn_with_its_verified_chain_highlighted(tmp_path: Path) -> None:
    sink, ledger = FileStagingSink(tmp_path), FileLineageResolver(tmp_path)
    for turn in conversation("r1", 3):
        assert sink.stage(turn.call).ok
        asyncio.run(ledger.record(commit_for(turn)))
    svg = tmp_path / "r1.svg"
    completed = tokcap("inspect", str(tmp_path), "r1", "--svg", str(svg), "--json")
    assert completed.returncode == 0, completed.stderr
    assert completed.json()["staging_chain"] == ["call-0", "call-1", "call-2"]
    calls = _calls(svg)
    assert [call for call, (terminal, _, _) in calls.items() if terminal] == ["call-0", "call-1", "call-2"]
    assert "delivered" in _header(svg)


def test_drawing_needs_a_rollout(demo_store: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    directory, _ = demo_store
    completed = tokcap("inspect", str(directory), "--svg", str(tmp_path / "all.svg"))
    assert completed.returncode == 1
    assert "--svg and --html draw one rollout" in completed.stderr
    assert not (tmp_path / "all.svg").exists()


def test_a_retired_rollout_is_drawn_as_retired_with_nothing_left_to_draw(
    demo_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory, faults = demo_store
    rollout = faults[FAULT_RETRY]["rollout_id"]
    svg = tmp_path / "retired.svg"
    assert tokcap("inspect", str(directory), rollout, "--svg", str(svg)).returncode == 0
    assert _calls(svg) == {}
    header = _header(svg)
    assert "retired (records removed)" in header
    assert any("only its fence is kept, so there is nothing to draw" in line for line in header)


def test_records_without_lineage_are_drawn_on_the_parent_links_the_builder_joined_them_by(
    tmp_path: Path,
) -> None:
    store = TokenCaptureStore(tmp_path)
    store.append(make_entry("r1", "c1", prompt=[1, 2, 3], generation=[4, 5], created_at=1.0))
    store.append(make_entry("r1", "c2", prompt=[1, 2, 3, 4, 5, 6], generation=[7], created_at=2.0))
    store.append(make_entry("r1", "side", prompt=[1, 2, 3, 4, 5, 9], generation=[10], created_at=3.0))
    store.append(make_entry("r1", "c3", prompt=[1, 2, 3, 4, 5, 6, 7, 8], generation=[11], created_at=4.0))
    svg = tmp_path / "r1.svg"
    assert tokcap("inspect", str(tmp_path), "r1", "--svg", str(svg)).returncode == 0
    parents = {
        group.get("data-call-id"): group.get("data-parent-id")
        for group in ET.parse(svg).getroot().iter(f"{_SVG}g")
        if group.get("class") == "call"
    }
    assert parents == {"c1": None, "c2": "c1", "c3": "c2", "side": "c1"}
    assert [call for call, (terminal, _, _) in _calls(svg).items() if terminal] == ["c1", "c2", "c3"]

"""The snippets of docs/gym.md run as written, against Gym 0.7.0 and tokcap's file store."""

from __future__ import annotations

import ast
import asyncio
import re
import textwrap
from pathlib import Path
from typing import Any

import yaml
from gym_rollouts import drive, tool_use_rollout
from gym_wheel import GymModules, needs_gym_build_sink

from tokcap.lineage import FileLineageResolver
from tokcap.store import TokenCaptureStore

DOC = Path(__file__).resolve().parents[2] / "docs" / "gym.md"
PLACEHOLDER = "/var/lib/tokcap/run-1"


def _blocks(language: str, directory: Path) -> list[str]:
    text = DOC.read_text().replace(PLACEHOLDER, str(directory))
    fence = re.compile(rf"^([ \t]*)```{language}\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
    return [textwrap.dedent(match.group(2)) for match in fence.finditer(text)]


def _run(snippet: str, namespace: dict[str, Any]) -> None:
    """Run a snippet as a notebook would: top-level ``await`` allowed."""
    code = compile(snippet, str(DOC), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)
    if asyncio.iscoroutine(result):
        asyncio.run(result)


def _capture(gym: GymModules, sink: Any, lineage: Any, rollout_id: str) -> dict[str, Any]:
    rollout = tool_use_rollout(rollout_id)

    async def run() -> None:
        await drive(gym, rollout, sink, lineage)
        await lineage.close()
        await sink.close()

    asyncio.run(run())
    return rollout.result()


def test_the_doc_has_a_server_snippet_and_a_trainer_snippet(tmp_path: Path) -> None:
    snippets = _blocks("python", tmp_path)
    assert len(snippets) == 6
    assert "build_sink" in snippets[0]
    assert "finalize_rollout_token_capture" in snippets[1]
    assert "install_capture" in snippets[2]
    assert "finalize_rollout(" in snippets[3]
    assert "KafkaStagingSink(" in snippets[4] and "KafkaStagingSource(" in snippets[4]
    compile(snippets[4], str(DOC), "exec")
    assert "run_staging_conformance" in snippets[5]


def test_the_staging_worker_snippet_stages_through_gyms_capture_and_fetches_a_prefix_back(
    gym: GymModules, tmp_path: Path
) -> None:
    import importlib

    staging = importlib.import_module("nemo_gym.token_id_capture.staging")
    namespace: dict[str, Any] = {"serving_layer": staging.CaptureHost(), "current_weight_version": lambda: 3}
    _run(_blocks("python", tmp_path)[2], namespace)
    capture = namespace["capture"]
    assert namespace["serving_layer"].token_capture is capture
    root = capture.begin_call(staging.CaptureAdmission(rollout_id="docs-s", model_call_id="c0", mode="text"))
    coords = capture.complete_call(
        root, prompt_token_ids=[1, 2], generated_token_ids=[3], generated_logprobs=[-0.5]
    )
    assert coords.disposition == "staged"
    child = staging.CaptureAdmission(
        rollout_id="docs-s",
        model_call_id="c1",
        parent_call_id="c0",
        prev_len=3,
        mode="token_in",
        staging_chain=[coords.staging_key],
        parent_chain_hash=coords.chain_hash,
    )
    assert namespace["prefix_of"](child) == [1, 2, 3]


def test_the_staging_trainer_snippet_finalizes_a_staged_rollout_and_retires_it(tmp_path: Path) -> None:
    from staging_calls import commit_for, conversation, cumulative_tokens

    from tokcap.staging import FileStagingSink

    turns = conversation("docs-t", 3)
    ledger = FileLineageResolver(tmp_path)
    for turn in turns:
        assert FileStagingSink(tmp_path).stage(turn.call).ok
        asyncio.run(ledger.record(commit_for(turn)))
    namespace: dict[str, Any] = {"rollout_id": "docs-t"}
    _run(_blocks("python", tmp_path)[3], namespace)
    assert namespace["tokens"] == cumulative_tokens(turns[-1].call)
    assert asyncio.run(ledger.manifest("docs-t"))["records"] == []


def test_the_staging_conformance_snippet_passes_on_the_file_transport(
    gym: GymModules, tmp_path: Path
) -> None:
    from tokcap.staging import FileStagingSink, FileStagingSource

    namespace: dict[str, Any] = {
        "FileStagingSink": FileStagingSink,
        "FileStagingSource": FileStagingSource,
        "FileLineageResolver": FileLineageResolver,
    }
    _run(_blocks("python", tmp_path)[5], namespace)
    assert len(namespace["passed"]) == 9


def test_the_trainer_snippet_rebuilds_and_retires_a_rollout_gym_captured_into_tokcap(
    gym: GymModules, tmp_path: Path
) -> None:
    record = _capture(gym, TokenCaptureStore(tmp_path), gym.lineage.FileLineageStore(tmp_path), "docs-1")
    namespace: dict[str, Any] = {"record": record}
    _run(_blocks("python", tmp_path)[1], namespace)
    assert namespace["built"]["mask_sample"] is False
    assert namespace["retired"] is True
    gym.builder.assert_prefix_contiguity(record["response"])


@needs_gym_build_sink
def test_the_server_snippet_builds_tokcaps_sink_and_tokcaps_lineage_resolver_from_the_documented_block(
    gym: GymModules, tmp_path: Path
) -> None:
    file_store_block = _blocks("yaml", tmp_path)[0]
    namespace: dict[str, Any] = {"global_config": yaml.safe_load(file_store_block)}
    _run(_blocks("python", tmp_path)[0], namespace)
    assert isinstance(namespace["sink"], TokenCaptureStore)
    assert isinstance(namespace["lineage"], FileLineageResolver)
    record = _capture(gym, namespace["sink"], namespace["lineage"], "docs-2")
    trainer: dict[str, Any] = {"record": record}
    _run(_blocks("python", tmp_path)[1], trainer)
    assert trainer["built"]["mask_sample"] is False
    assert trainer["retired"] is True

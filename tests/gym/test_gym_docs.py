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
    assert len(snippets) == 2
    assert "build_sink" in snippets[0]
    assert "finalize_rollout_token_capture" in snippets[1]


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

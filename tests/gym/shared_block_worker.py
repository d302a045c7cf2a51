"""One model-server process (and its inference worker) built from a config file with Gym 0.7.0's own path.

``python shared_block_worker.py CONFIG WHO PEER OUT``: Gym's ``token_id_capture_config`` reads the file's
block, ``build_sink`` and ``build_lineage_store`` build what it names, and the staging sink comes from the
block's ``lineage_store_kwargs`` as a framework builds it. Without ``external_staging`` the process drives a
rollout through Gym's capture middleware; with it, it stages a three-call rollout, resolves each
continuation's parent through the ledger and records every call. It then writes ``OUT/WHO.done`` and waits
for ``OUT/PEER.done``, reads the peer's rollout through its own ledger, and writes what it saw to
``OUT/WHO.json``.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import yaml
from gym_rollouts import drive, tool_use_rollout
from gym_wheel import load_gym
from staging_calls import commit_for, conversation

from tokcap.records import ParentResolutionStatus

STAGING_SINKS = {
    "tokcap.lineage:FileLineageResolver": "tokcap.staging:FileStagingSink",
    "transports.kafka.lineage:KafkaLineageResolver": "transports.kafka.staging:KafkaStagingSink",
}
"""The staging sink a framework builds beside each ledger, from the same ``lineage_store_kwargs``."""


def built(target: str, kwargs: dict[str, Any]) -> Any:
    module_name, class_name = target.split(":")
    module = __import__(module_name, fromlist=[class_name])
    return getattr(module, class_name)(**kwargs)


async def closed(instance: Any) -> None:
    close = getattr(instance, "close", None)
    if callable(close):
        result = close()
        if inspect.isawaitable(result):
            await result


async def serve_puts(gym: Any, config: Any, who: str) -> dict[str, Any]:
    sink, lineage = config.build_sink(), config.build_lineage_store()
    try:
        await drive(gym, tool_use_rollout(f"{who}-put", retry_last=False), sink, lineage)
    finally:
        await closed(sink)
        await closed(lineage)
    return {}


async def serve_staged(config: Any, block: dict[str, Any], who: str, peer: str, out: Path) -> dict[str, Any]:
    ledger = config.build_lineage_store()
    sink = built(STAGING_SINKS[block["lineage_store"]], block["lineage_store_kwargs"])
    resolved: list[str | None] = []
    try:
        for turn in conversation(f"{who}-staged", 3, extras=True):
            if turn.staging_chain:
                resolution = await ledger.resolve(turn.call.rollout_id, turn.request_items)
                assert resolution.status == ParentResolutionStatus.RESOLVED, resolution
                resolved.append(resolution.match.model_call_id)
            assert sink.stage(turn.call, attachments={"image": bytes(range(256)) * 64}).ok
            await ledger.record(commit_for(turn))
        (out / f"{who}.done").write_bytes(b"")
        deadline = time.monotonic() + 60
        while not (out / f"{peer}.done").exists():
            assert time.monotonic() < deadline, f"{peer} did not finish"
            await asyncio.sleep(0.05)
        peers = await ledger.manifest(f"{peer}-staged")
        return {"resolved": resolved, "peer_calls": [row["model_call_id"] for row in peers["records"]]}
    finally:
        await closed(sink)
        await closed(ledger)


def main(config_path: str, who: str, peer: str, out_dir: str) -> None:
    gym = load_gym()
    global_config = yaml.safe_load(Path(config_path).read_text())
    config = gym.config.token_id_capture_config(global_config)
    block = global_config["token_id_capture"]
    out = Path(out_dir)
    if block.get("external_staging"):
        seen = asyncio.run(serve_staged(config, block, who, peer, out))
    else:
        seen = asyncio.run(serve_puts(gym, config, who))
        (out / f"{who}.done").write_bytes(b"")
    (out / f"{who}.json").write_bytes(orjson.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:])

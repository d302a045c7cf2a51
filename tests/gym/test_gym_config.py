"""One ``token_id_capture`` block for both: tokcap accepts and refuses what Gym 0.7.0's validation does."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from gym_wheel import GymModules, needs_gym_build_sink
from pydantic import ValidationError

from tokcap.config import token_id_capture_config
from tokcap.errors import ConfigError
from tokcap.lineage import FileLineageResolver
from tokcap.store import TokenCaptureStore
from transports.kafka.lineage import KafkaLineageResolver

REPO = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"```ya?ml\n(.*?)```", re.DOTALL)


def _capture_configs(value: Any) -> list[dict[str, Any]]:
    """Every mapping in a parsed document that holds a ``token_id_capture`` block (the global config level)."""
    found: list[dict[str, Any]] = []
    if isinstance(value, dict):
        if "token_id_capture" in value:
            found.append(value)
        for child in value.values():
            found.extend(_capture_configs(child))
    elif isinstance(value, list):
        for child in value:
            found.extend(_capture_configs(child))
    return found


def documented_configs() -> list[tuple[str, dict[str, Any]]]:
    """(where, global config) for every YAML example with a capture block in README.md and docs/."""
    examples: list[tuple[str, dict[str, Any]]] = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for number, block in enumerate(_FENCE.findall(path.read_text()), start=1):
            if "token_id_capture" not in block:
                continue
            for config in _capture_configs(yaml.safe_load(block)):
                examples.append((f"{path.relative_to(REPO)} yaml block {number}", config))
    return examples


def test_the_docs_hold_capture_config_examples() -> None:
    places = {where.split(" ")[0] for where, _ in documented_configs()}
    assert {"docs/operations.md", "docs/gym.md"} <= places


@pytest.mark.parametrize(("where", "config"), documented_configs(), ids=[w for w, _ in documented_configs()])
def test_every_documented_config_passes_gyms_validation_and_tokcaps(
    gym: GymModules, where: str, config: dict[str, Any]
) -> None:
    gym.config.TokenIdCaptureConfig.model_validate(config)
    token_id_capture_config(config)


def _block(**keys: Any) -> dict[str, Any]:
    return {"token_id_capture": keys}


BLOCKS: dict[str, dict[str, Any]] = {
    "disabled defaults": _block(),
    "file store dir": _block(enabled=True, dir="/var/tokcap"),
    "fallback dir": {"token_id_capture": {"enabled": True}, "model_call_capture_dir": "/var/tokcap"},
    "relative dir": _block(enabled=True, dir="relative/dir"),
    "no dir": _block(enabled=True),
    "no dir, no rebuild": _block(enabled=True, rebuild_response=False),
    "custom sink alone": _block(enabled=True, sink="transports.kafka:KafkaTokenSink"),
    "custom sink, disabled": _block(sink="transports.kafka:KafkaTokenSink"),
    "custom sink with lineage store": _block(
        enabled=True,
        sink="transports.kafka:KafkaTokenSink",
        lineage_store="x.y:Resolver",
        lineage_store_kwargs={"a": 1},
    ),
    "custom sink with tokcap's kafka resolver": _block(
        enabled=True,
        sink="transports.kafka:KafkaTokenSink",
        lineage_store="transports.kafka.lineage:KafkaLineageResolver",
        lineage_store_kwargs={"bootstrap_servers": "127.0.0.1:9"},
    ),
    "custom sink, unresolved allowed": _block(
        enabled=True, sink="transports.kafka:KafkaTokenSink", allow_unresolved_continuations=True
    ),
    "delta records": _block(enabled=True, dir="/var/tokcap", delta_records=True),
    "external staging": _block(
        enabled=True,
        external_staging=True,
        rebuild_response=False,
        sink="a.b:S",
        lineage_store="a.b:L",
        external_staging_backend="megatron_worker",
    ),
    "external staging disabled": _block(external_staging=True, rebuild_response=False),
    "external staging rebuilding": _block(enabled=True, external_staging=True, dir="/var/tokcap"),
    "megatron without staging": _block(external_staging_backend="megatron_worker"),
    "unknown backend": _block(external_staging_backend="tpu_worker"),
    "empty control env": _block(control_auth_token_env=""),
    "control env": _block(control_auth_token_env="MY_TOKEN"),
    "unknown key": _block(enabeld=True),
    "all agents": _block(enabled=True, all_agents=True, dir="/var/tokcap"),
    "mask fraction": _block(
        enabled=True, dir="/var/tokcap", max_mask_fraction=0.5, mask_fraction_min_samples=20
    ),
}


def _verdict(validate: Any, config: dict[str, Any]) -> str:
    try:
        validate(config)
    except (ValidationError, ConfigError, ValueError):
        return "refused"
    return "accepted"


@pytest.mark.parametrize("case", sorted(BLOCKS))
def test_a_block_is_accepted_or_refused_by_tokcap_exactly_as_by_gym(gym: GymModules, case: str) -> None:
    config = BLOCKS[case]
    assert _verdict(token_id_capture_config, config) == _verdict(
        gym.config.TokenIdCaptureConfig.model_validate, config
    )


def test_every_gym_key_is_a_tokcap_key_with_gyms_default(gym: GymModules) -> None:
    from tokcap.config import TokenIdCaptureSettings

    theirs = gym.config.TokenIdCaptureSettings.model_fields
    ours = TokenIdCaptureSettings.model_fields
    assert set(theirs) <= set(ours)
    for name, field in theirs.items():
        assert ours[name].get_default(call_default_factory=True) == field.get_default(
            call_default_factory=True
        )


@needs_gym_build_sink
def test_gyms_build_sink_builds_tokcaps_file_store_from_the_block(gym: GymModules, tmp_path: Path) -> None:
    config = gym.config.TokenIdCaptureConfig.model_validate(
        _block(
            enabled=True,
            sink="tokcap.store:TokenCaptureStore",
            sink_kwargs={"root": str(tmp_path)},
            lineage_store="nemo_gym.token_id_capture.lineage:FileLineageStore",
            lineage_store_kwargs={"root": str(tmp_path)},
        )
    )
    sink = config.build_sink()
    assert isinstance(sink, TokenCaptureStore)
    assert isinstance(sink, gym.protocols.TokenSink)
    assert config.build_lineage_store() is not None


@needs_gym_build_sink
def test_gyms_build_sink_builds_the_kafka_sink_from_the_documented_block(gym: GymModules) -> None:
    from transports.kafka import KafkaTokenSink

    config = gym.config.TokenIdCaptureConfig.model_validate(
        _block(
            enabled=True,
            sink="transports.kafka:KafkaTokenSink",
            sink_kwargs={"bootstrap_servers": "127.0.0.1:9", "run_id": "gym-config", "delivery_timeout_s": 1},
            lineage_store="transports.kafka.lineage:KafkaLineageResolver",
            lineage_store_kwargs={"bootstrap_servers": "127.0.0.1:9", "run_id": "gym-config"},
        )
    )
    sink = config.build_sink()
    lineage = config.build_lineage_store()
    try:
        assert isinstance(sink, KafkaTokenSink)
        assert isinstance(sink, gym.protocols.TokenSink)
        assert isinstance(lineage, KafkaLineageResolver)
        assert isinstance(lineage, gym.protocols.LineageResolver)
    finally:
        import asyncio

        asyncio.run(sink.close())
        asyncio.run(lineage.close())


@pytest.mark.parametrize(
    ("target", "kwargs", "expected"),
    [
        ("tokcap.lineage:FileLineageResolver", {"root": "DIR"}, FileLineageResolver),
        (
            "transports.kafka.lineage:KafkaLineageResolver",
            {"bootstrap_servers": "127.0.0.1:9", "run_id": "config"},
            KafkaLineageResolver,
        ),
    ],
)
def test_tokcaps_config_builds_tokcaps_resolvers_named_in_the_block_and_they_satisfy_gyms_protocol(
    gym: GymModules, tmp_path: Path, target: str, kwargs: dict[str, Any], expected: type
) -> None:
    kwargs = {key: str(tmp_path) if value == "DIR" else value for key, value in kwargs.items()}
    config = token_id_capture_config(
        _block(
            enabled=True,
            sink="transports.kafka:KafkaTokenSink",
            lineage_store=target,
            lineage_store_kwargs=kwargs,
        )
    )
    lineage = config.build_lineage_store()
    try:
        assert isinstance(lineage, expected)
        assert isinstance(lineage, gym.protocols.LineageResolver)
        assert lineage.is_process_shared() is True
    finally:
        import asyncio

        asyncio.run(lineage.close())

"""Capture settings: validation, directory resolution, sink building and per-agent enablement."""

from __future__ import annotations

import asyncio
import logging
import math
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from factories import make_entry

from tokcap.config import (
    TOKEN_ID_CAPTURE_BLOCK,
    TokenIdCaptureConfig,
    TokenIdCaptureSettings,
    token_id_capture_config,
    token_id_capture_enabled_for_agent,
)
from tokcap.errors import ConfigError, SinkConfigError
from tokcap.files.store import TokenCaptureStore, make_token_store
from tokcap.protocols import TokenSink, install_token_sink, installed_token_sink

_SINK_MODULE_SOURCE = textwrap.dedent(
    """
    class GoodSink:
        def __init__(self, label="default"):
            self.label = label
            self.entries = []
            self.incomplete = []
            self.closed = False

        async def put(self, entry):
            self.entries.append(entry)

        async def mark_incomplete(self, rollout_id, model_call_id=""):
            self.incomplete.append((rollout_id, model_call_id))

        async def close(self):
            self.closed = True


    class Outer:
        Inner = GoodSink


    class SinkWithoutMarkIncomplete:
        async def put(self, entry):
            pass

        async def close(self):
            pass


    class SinkWithoutPut:
        async def mark_incomplete(self, rollout_id, model_call_id=""):
            pass

        async def close(self):
            pass


    class SinkWithSyncClose:
        async def put(self, entry):
            pass

        async def mark_incomplete(self, rollout_id, model_call_id=""):
            pass

        def close(self):
            pass


    class ExplodingSink(GoodSink):
        def __init__(self):
            raise RuntimeError("broker unreachable")


    NOT_A_CLASS = 42
    """
)


@pytest.fixture
def sink_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A uniquely named importable module holding good and bad sink classes."""
    name = f"tokcap_test_sinks_{uuid.uuid4().hex}"
    package_dir = tmp_path / "sinkmods"
    package_dir.mkdir()
    (package_dir / f"{name}.py").write_text(_SINK_MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(package_dir))
    return name


@pytest.fixture
def broken_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module that raises while it is being imported."""
    name = f"tokcap_test_broken_{uuid.uuid4().hex}"
    package_dir = tmp_path / "brokenmods"
    package_dir.mkdir()
    (package_dir / f"{name}.py").write_text("raise RuntimeError('module-level failure')\n")
    monkeypatch.syspath_prepend(str(package_dir))
    return name


@pytest.fixture(autouse=True)
def _no_installed_sink() -> Iterator[None]:
    """Start every test with no installed sink and restore whatever was there."""
    previous = installed_token_sink()
    install_token_sink(None)
    yield
    install_token_sink(previous)


_RESOLVER = "some_backend.lineage:Resolver"
"""A lineage store target: validation needs one beside a custom sink; only build_lineage_store imports it."""


def _with_sink(target: str, **sink_kwargs: Any) -> TokenIdCaptureConfig:
    return token_id_capture_config(
        {
            TOKEN_ID_CAPTURE_BLOCK: {
                "enabled": True,
                "sink": target,
                "sink_kwargs": sink_kwargs,
                "lineage_store": _RESOLVER,
            }
        }
    )


# --- settings block ---------------------------------------------------------------------------------------


def test_the_block_defaults_leave_capture_disabled_with_the_file_store() -> None:
    settings = TokenIdCaptureSettings()
    assert settings.enabled is False
    assert settings.all_agents is False
    assert settings.dir is None
    assert settings.sink is None
    assert settings.sink_kwargs == {}
    assert settings.rebuild_response is True
    assert settings.max_mask_fraction is None
    assert settings.mask_fraction_min_samples == 50


def test_sink_kwargs_defaults_are_not_shared_between_blocks() -> None:
    first, second = TokenIdCaptureSettings(), TokenIdCaptureSettings()
    first.sink_kwargs["x"] = 1
    assert second.sink_kwargs == {}


def test_the_block_name_is_token_id_capture() -> None:
    assert TOKEN_ID_CAPTURE_BLOCK == "token_id_capture"


def test_an_unknown_key_in_the_block_is_refused_and_named() -> None:
    with pytest.raises(ConfigError, match=r"token_id_capture\.enabeld"):
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabeld": True}})


@pytest.mark.parametrize("fraction", [-0.01, 1.01, math.nan])
def test_a_max_mask_fraction_outside_zero_to_one_is_refused(fraction: float) -> None:
    with pytest.raises(ConfigError, match=r"token_id_capture\.max_mask_fraction"):
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"max_mask_fraction": fraction}})


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_a_max_mask_fraction_from_zero_to_one_is_accepted(fraction: float) -> None:
    config = token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"max_mask_fraction": fraction}})
    assert config.token_id_capture.max_mask_fraction == fraction


def test_a_mask_fraction_min_samples_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"token_id_capture\.mask_fraction_min_samples"):
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"mask_fraction_min_samples": 0}})


def test_a_mask_fraction_min_samples_of_one_is_accepted() -> None:
    config = token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"mask_fraction_min_samples": 1}})
    assert config.token_id_capture.mask_fraction_min_samples == 1


def test_a_blank_sink_target_is_refused_rather_than_read_as_no_sink() -> None:
    with pytest.raises(ConfigError, match="blank"):
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "sink": "  "}})


# --- reading the global config ----------------------------------------------------------------------------


def test_no_global_config_reads_as_the_defaults() -> None:
    config = token_id_capture_config(None)
    assert config.enabled is False
    assert config.token_id_capture == TokenIdCaptureSettings()
    assert config.resolved_dir() is None


def test_an_empty_block_reads_as_the_defaults() -> None:
    assert (
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: None}).token_id_capture == TokenIdCaptureSettings()
    )


@pytest.mark.parametrize("not_a_mapping", [["token_id_capture"], "enabled: true", 3])
def test_a_global_config_that_is_not_a_mapping_is_refused(not_a_mapping: Any) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        token_id_capture_config(not_a_mapping)


def test_unrelated_top_level_keys_are_ignored() -> None:
    config = token_id_capture_config({"policy_model": {"x": 1}, "num_workers": 8})
    assert config.enabled is False


def test_read_only_mappings_are_accepted_at_every_level(tmp_path: Path) -> None:
    block = MappingProxyType(
        {"enabled": True, "dir": str(tmp_path), "sink_kwargs": MappingProxyType({"a": 1})}
    )
    config = token_id_capture_config(MappingProxyType({TOKEN_ID_CAPTURE_BLOCK: block}))
    assert config.enabled is True
    assert config.token_id_capture.sink_kwargs == {"a": 1}


def test_config_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"bogus": 1}})


def test_a_config_error_names_every_bad_key() -> None:
    with pytest.raises(ConfigError) as info:
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"bogus": 1, "all_agents": "perhaps"}})
    assert "token_id_capture.bogus" in str(info.value)
    assert "token_id_capture.all_agents" in str(info.value)


def test_enabled_mirrors_the_block(tmp_path: Path) -> None:
    config = token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "dir": str(tmp_path)}})
    assert config.enabled is True
    assert token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": False}}).enabled is False


# --- directory resolution ---------------------------------------------------------------------------------


def test_the_block_dir_wins_over_the_top_level_fallback(tmp_path: Path) -> None:
    config = token_id_capture_config(
        {
            TOKEN_ID_CAPTURE_BLOCK: {"dir": str(tmp_path / "block")},
            "model_call_capture_dir": str(tmp_path / "top"),
        }
    )
    assert config.resolved_dir() == tmp_path / "block"


def test_the_top_level_model_call_capture_dir_is_the_fallback(tmp_path: Path) -> None:
    config = token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {}, "model_call_capture_dir": str(tmp_path)})
    assert config.resolved_dir() == tmp_path


def test_enabled_without_a_sink_and_without_any_directory_is_refused() -> None:
    with pytest.raises(ConfigError, match="no directory resolves"):
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True}})


def test_enabled_with_a_relative_block_dir_is_refused() -> None:
    with pytest.raises(ConfigError, match="absolute"):
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "dir": "relative/tokens"}})


def test_enabled_with_a_relative_fallback_dir_is_refused() -> None:
    with pytest.raises(ConfigError, match="absolute"):
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True}, "model_call_capture_dir": "rel"})


def test_enabled_with_an_absolute_fallback_dir_is_accepted(tmp_path: Path) -> None:
    config = token_id_capture_config(
        {TOKEN_ID_CAPTURE_BLOCK: {"enabled": True}, "model_call_capture_dir": tmp_path}
    )
    assert config.resolved_dir() == tmp_path


def test_disabled_capture_needs_no_directory() -> None:
    assert (
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": False, "dir": "rel"}}).enabled is False
    )


def test_enabled_without_a_directory_is_accepted_when_a_sink_is_installed(tmp_path: Path) -> None:
    install_token_sink(TokenCaptureStore(tmp_path))
    config = token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "lineage_store": _RESOLVER}})
    assert config.enabled is True


def test_enabled_without_a_directory_is_accepted_when_gym_does_not_rebuild() -> None:
    config = token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "rebuild_response": False}})
    assert config.resolved_dir() is None


def test_enabled_with_a_configured_sink_needs_no_directory(sink_module: str) -> None:
    assert _with_sink(f"{sink_module}:GoodSink").resolved_dir() is None


def test_a_dir_set_beside_a_sink_logs_a_warning(
    sink_module: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tokcap.config"):
        token_id_capture_config(
            {
                TOKEN_ID_CAPTURE_BLOCK: {
                    "enabled": True,
                    "dir": str(tmp_path),
                    "sink": f"{sink_module}:GoodSink",
                    "lineage_store": _RESOLVER,
                }
            }
        )
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(tmp_path) in warnings[0].getMessage()
    assert "ignored" in warnings[0].getMessage()


def test_a_dir_without_a_sink_logs_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tokcap.config"):
        token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "dir": str(tmp_path)}})
    assert [record for record in caplog.records if record.levelno >= logging.WARNING] == []


# --- building the sink ------------------------------------------------------------------------------------


def test_no_sink_is_built_when_the_file_store_is_in_use(tmp_path: Path) -> None:
    config = token_id_capture_config({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "dir": str(tmp_path)}})
    assert config.build_sink() is None


def test_a_good_target_builds_a_sink_with_the_configured_kwargs(sink_module: str) -> None:
    sink = _with_sink(f"{sink_module}:GoodSink", label="from-config").build_sink()
    assert isinstance(sink, TokenSink)
    assert type(sink).__name__ == "GoodSink"
    assert sink.label == "from-config"  # type: ignore[attr-defined]


def test_a_nested_class_target_is_resolved_attribute_by_attribute(sink_module: str) -> None:
    sink = _with_sink(f"{sink_module}:Outer.Inner").build_sink()
    assert type(sink).__name__ == "GoodSink"


def test_the_file_store_built_from_config_is_a_working_sink(tmp_path: Path) -> None:
    sink = _with_sink("tokcap.store:TokenCaptureStore", root=str(tmp_path)).build_sink()
    assert isinstance(sink, TokenCaptureStore)

    async def capture() -> None:
        await sink.put(make_entry("r1", "c1"))
        await sink.close()

    asyncio.run(capture())
    assert TokenCaptureStore(tmp_path).read_entries("r1") == [make_entry("r1", "c1")]


def test_each_build_constructs_a_fresh_sink(sink_module: str) -> None:
    config = _with_sink(f"{sink_module}:GoodSink")
    assert config.build_sink() is not config.build_sink()


@pytest.mark.parametrize(
    "target",
    [
        "module_without_colon",
        "pkg.mod:Cls:Extra",
        ":ClassName",
        "pkg.mod:",
        "pkg..mod:Cls",
        "my-pkg.mod:Cls",
        "pkg.mod:1Cls",
        "pkg.mod:Cls()",
    ],
)
def test_a_malformed_target_is_refused_and_named(target: str) -> None:
    with pytest.raises(SinkConfigError, match="malformed") as info:
        _with_sink(target).build_sink()
    assert repr(target) in str(info.value)


def test_a_module_that_cannot_be_found_is_refused_and_named() -> None:
    target = "tokcap_no_such_module_anywhere.sinks:Sink"
    with pytest.raises(SinkConfigError, match="could not be imported") as info:
        _with_sink(target).build_sink()
    assert repr(target) in str(info.value)
    assert "tokcap_no_such_module_anywhere" in str(info.value)


def test_a_module_that_raises_while_importing_is_refused_with_the_cause(broken_module: str) -> None:
    target = f"{broken_module}:Sink"
    with pytest.raises(SinkConfigError, match="module-level failure") as info:
        _with_sink(target).build_sink()
    assert repr(target) in str(info.value)
    assert "RuntimeError" in str(info.value)


def test_a_missing_class_is_refused_and_named(sink_module: str) -> None:
    target = f"{sink_module}:NoSuchSink"
    with pytest.raises(SinkConfigError, match="no attribute 'NoSuchSink'") as info:
        _with_sink(target).build_sink()
    assert repr(target) in str(info.value)


def test_a_target_that_is_not_callable_is_refused(sink_module: str) -> None:
    with pytest.raises(SinkConfigError, match="not a class"):
        _with_sink(f"{sink_module}:NOT_A_CLASS").build_sink()


def test_a_constructor_that_rejects_the_kwargs_is_refused_and_names_them(sink_module: str) -> None:
    target = f"{sink_module}:GoodSink"
    with pytest.raises(SinkConfigError, match="rejected sink_kwargs") as info:
        _with_sink(target, bootstrap_servers="localhost:9092").build_sink()
    assert repr(target) in str(info.value)
    assert "bootstrap_servers" in str(info.value)


def test_a_constructor_that_raises_is_refused_with_the_cause(sink_module: str) -> None:
    target = f"{sink_module}:ExplodingSink"
    with pytest.raises(SinkConfigError, match="broker unreachable") as info:
        _with_sink(target).build_sink()
    assert repr(target) in str(info.value)


def test_a_sink_without_mark_incomplete_is_refused_because_it_would_hide_lost_turns(sink_module: str) -> None:
    target = f"{sink_module}:SinkWithoutMarkIncomplete"
    with pytest.raises(SinkConfigError, match="hide lost turns") as info:
        _with_sink(target).build_sink()
    assert "mark_incomplete" in str(info.value)
    assert repr(target) in str(info.value)


def test_a_sink_without_put_is_refused_and_the_method_named(sink_module: str) -> None:
    with pytest.raises(SinkConfigError, match=r"no put\(\) method"):
        _with_sink(f"{sink_module}:SinkWithoutPut").build_sink()


def test_a_sink_with_a_synchronous_method_is_refused_and_the_method_named(sink_module: str) -> None:
    with pytest.raises(SinkConfigError, match=r"close\(\) must be an async method"):
        _with_sink(f"{sink_module}:SinkWithSyncClose").build_sink()


def test_sink_errors_are_config_errors_and_value_errors() -> None:
    with pytest.raises(SinkConfigError) as info:
        _with_sink("no_colon").build_sink()
    assert isinstance(info.value, ConfigError)
    assert isinstance(info.value, ValueError)


# --- per-agent enablement ---------------------------------------------------------------------------------


def _global_config(
    tmp_path: Path, *, enabled: bool = True, all_agents: bool = False, **agents: Any
) -> dict[str, Any]:
    return {
        TOKEN_ID_CAPTURE_BLOCK: {"enabled": enabled, "all_agents": all_agents, "dir": str(tmp_path)},
        **agents,
    }


def _agent(flag: Any) -> dict[str, Any]:
    return {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py", TOKEN_ID_CAPTURE_BLOCK: flag}}}


def test_no_agent_participates_when_capture_is_disabled(tmp_path: Path) -> None:
    config = _global_config(tmp_path, enabled=False, all_agents=True, math_agent=_agent(True))
    assert token_id_capture_enabled_for_agent(config, "math_agent") is False


def test_no_agent_name_never_participates(tmp_path: Path) -> None:
    assert token_id_capture_enabled_for_agent(_global_config(tmp_path, all_agents=True), None) is False


def test_all_agents_enables_every_agent_even_without_its_flag(tmp_path: Path) -> None:
    config = _global_config(tmp_path, all_agents=True, math_agent=_agent(False))
    assert token_id_capture_enabled_for_agent(config, "math_agent") is True
    assert token_id_capture_enabled_for_agent(config, "unlisted_agent") is True


def test_the_agents_static_flag_enables_that_agent(tmp_path: Path) -> None:
    config = _global_config(tmp_path, math_agent=_agent(True))
    assert token_id_capture_enabled_for_agent(config, "math_agent") is True


def test_the_flag_is_found_under_any_agent_key(tmp_path: Path) -> None:
    agent = {"responses_api_agents": {"first": {}, "second": {TOKEN_ID_CAPTURE_BLOCK: True}}}
    assert (
        token_id_capture_enabled_for_agent(_global_config(tmp_path, math_agent=agent), "math_agent") is True
    )


def test_another_agents_flag_does_not_enable_this_agent(tmp_path: Path) -> None:
    config = _global_config(tmp_path, math_agent=_agent(True), code_agent=_agent(False))
    assert token_id_capture_enabled_for_agent(config, "code_agent") is False


@pytest.mark.parametrize(
    "agent_config",
    [
        _agent(False),
        _agent(None),
        {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py"}}},
        {"responses_api_agents": {}},
        {"responses_api_agents": "not a mapping"},
        {"resources_servers": {"x": {TOKEN_ID_CAPTURE_BLOCK: True}}},
        "not a mapping",
    ],
)
def test_an_agent_without_a_truthy_flag_does_not_participate(tmp_path: Path, agent_config: Any) -> None:
    assert (
        token_id_capture_enabled_for_agent(_global_config(tmp_path, math_agent=agent_config), "math_agent")
        is False
    )


def test_an_unknown_agent_does_not_participate_without_all_agents(tmp_path: Path) -> None:
    assert token_id_capture_enabled_for_agent(_global_config(tmp_path), "ghost_agent") is False


def test_no_global_config_means_no_agent_participates() -> None:
    assert token_id_capture_enabled_for_agent(None, "math_agent") is False


# --- make_token_store -------------------------------------------------------------------------------------


def test_no_store_is_made_when_capture_is_disabled(tmp_path: Path) -> None:
    assert make_token_store({TOKEN_ID_CAPTURE_BLOCK: {"enabled": False, "dir": str(tmp_path)}}) is None
    assert make_token_store(None) is None


def test_no_store_is_made_when_a_sink_owns_the_records(sink_module: str, tmp_path: Path) -> None:
    global_config = {
        TOKEN_ID_CAPTURE_BLOCK: {
            "enabled": True,
            "sink": f"{sink_module}:GoodSink",
            "lineage_store": _RESOLVER,
        }
    }
    assert make_token_store(global_config) is None


def test_a_store_is_made_at_the_block_dir_when_capture_is_enabled(tmp_path: Path) -> None:
    store = make_token_store({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "dir": str(tmp_path)}})
    assert isinstance(store, TokenCaptureStore)
    assert store.root == tmp_path


def test_a_store_is_made_at_the_fallback_dir_when_the_block_has_none(tmp_path: Path) -> None:
    store = make_token_store(
        {TOKEN_ID_CAPTURE_BLOCK: {"enabled": True}, "model_call_capture_dir": str(tmp_path)}
    )
    assert isinstance(store, TokenCaptureStore)
    assert store.root == tmp_path


def test_no_store_is_made_when_no_directory_resolves_and_gym_does_not_rebuild() -> None:
    assert make_token_store({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "rebuild_response": False}}) is None


def test_make_token_store_refuses_an_invalid_config() -> None:
    with pytest.raises(ConfigError, match="absolute"):
        make_token_store({TOKEN_ID_CAPTURE_BLOCK: {"enabled": True, "dir": "relative"}})


def test_a_top_level_capture_dir_beside_a_sink_logs_no_warning(
    sink_module: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tokcap.config"):
        token_id_capture_config(
            {
                TOKEN_ID_CAPTURE_BLOCK: {
                    "enabled": True,
                    "sink": f"{sink_module}:GoodSink",
                    "lineage_store": _RESOLVER,
                },
                "model_call_capture_dir": str(tmp_path),
            }
        )
    assert [record for record in caplog.records if record.levelno >= logging.WARNING] == []

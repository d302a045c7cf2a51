"""Run-wide settings for training-token capture.

The settings live in the ``token_id_capture`` block of the global config.
The top-level ``model_call_capture_dir`` is the fallback file-store directory.
A configured ``sink`` (``module.path:ClassName``) replaces the file store.
Each server process builds its own sink at startup.
Spawned workers do not inherit a sink installed by a launcher.
``rebuild_response`` says whether tokcap reads the records back.
Set it to false when a framework reads through its own source.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokcap.errors import ConfigError, SinkConfigError
from tokcap.protocols import LineageResolver, TokenSink, installed_lineage_store, installed_token_sink

__all__ = [
    "TOKEN_ID_CAPTURE_BLOCK",
    "ExternalStagingBackend",
    "TokenIdCaptureConfig",
    "TokenIdCaptureSettings",
    "logger",
    "token_id_capture_config",
    "token_id_capture_enabled_for_agent",
]

TOKEN_ID_CAPTURE_BLOCK = "token_id_capture"
"""The key of the capture block in the global config and in an agent's config."""

logger = logging.getLogger(__name__)

_FALLBACK_DIR_KEY = "model_call_capture_dir"

ExternalStagingBackend = Literal["vllm_worker", "megatron_worker"]
"""Where an inference worker stages token deltas when ``external_staging`` is on (Gym's two backends)."""

_AGENTS_KEY = "responses_api_agents"

_WHY_METHOD_MATTERS: dict[str, str] = {
    "put": "without it no record can be stored",
    "mark_incomplete": "without it a failed capture would leave no trace and hide lost turns",
    "close": "without it pending records could not be flushed at shutdown",
    "freeze": "without it no atomic snapshot can be taken",
    "drop": "without it a consumed snapshot can never be retired",
    "resolve": "without it no continuation can find its parent",
    "is_process_shared": "without it Gym cannot tell whether workers share committed entries",
}


class TokenIdCaptureSettings(BaseModel):
    """The ``token_id_capture`` block, key for key Gym 0.7.0's.

    Unknown keys are refused so a typo cannot silently disable capture.
    tokcap is stricter than Gym on two values only: ``max_mask_fraction`` must lie in [0, 1] and
    ``mask_fraction_min_samples`` must be at least 1; a blank ``sink`` is refused.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    all_agents: bool = False
    dir: Path | None = None
    sink: str | None = None
    sink_kwargs: dict[str, Any] = Field(default_factory=dict)
    # A resolver over the entries the sink committed, on the same backend (Gym's middleware asks it for
    # each continuation's parent). A custom sink without one is refused unless the loss is accepted below.
    lineage_store: str | None = None
    lineage_store_kwargs: dict[str, Any] = Field(default_factory=dict)
    rebuild_response: bool = True
    allow_unresolved_continuations: bool = False
    # Gym stores resolved continuations as parent-relative suffixes (prompt_is_delta).
    delta_records: bool = False
    max_mask_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    mask_fraction_min_samples: int = Field(default=50, ge=1)
    # Gym's engine-side capture: an inference worker stages the tokens; tokcap only validates these keys.
    external_staging: bool = False
    external_staging_backend: ExternalStagingBackend = "vllm_worker"
    # The name of the environment variable holding the control-route bearer token (never the token itself).
    control_auth_token_env: str = Field(default="NEMO_GYM_TOKEN_CAPTURE_CONTROL_TOKEN", min_length=1)

    def resolve_control_auth_token(self) -> str:
        """Read the control bearer token from its environment variable, so it is never in the config."""
        token = os.environ.get(self.control_auth_token_env)
        if not token:
            raise ConfigError(
                "token_id_capture.external_staging needs a control bearer token in the environment "
                f"variable {self.control_auth_token_env}; set it in the serving process"
            )
        return token

    @field_validator("sink")
    @classmethod
    def _refuse_blank_sink(cls, value: str | None) -> str | None:
        """A blank target is ambiguous between "no sink" and a broken one, so it is refused."""
        if value is not None and not value.strip():
            raise ValueError(
                "sink is blank; name a class as 'module.path:ClassName', "
                "or leave sink unset to use the file store"
            )
        return value


class TokenIdCaptureConfig(BaseModel):
    """The capture block plus the one top-level key it falls back to; other global keys are ignored."""

    model_config = ConfigDict(extra="ignore")

    token_id_capture: TokenIdCaptureSettings = Field(default_factory=TokenIdCaptureSettings)
    model_call_capture_dir: Path | None = None

    @property
    def enabled(self) -> bool:
        """Whether training-token capture is on for this run."""
        return self.token_id_capture.enabled

    def resolved_dir(self) -> Path | None:
        """The file-store directory: the block's ``dir``, else the top-level ``model_call_capture_dir``."""
        if self.token_id_capture.dir is not None:
            return self.token_id_capture.dir
        return self.model_call_capture_dir

    @model_validator(mode="after")
    def _validate(self) -> TokenIdCaptureConfig:
        """Gym's rules: refuse at startup a block that would lose or mask turns without saying so."""
        settings = self.token_id_capture
        if settings.external_staging and not settings.enabled:
            raise ValueError("token_id_capture.external_staging requires token_id_capture.enabled")
        if settings.external_staging and settings.rebuild_response:
            raise ValueError(
                "token_id_capture.external_staging requires rebuild_response: false, because the framework "
                "owns the finalization of staged records"
            )
        if settings.external_staging_backend == "megatron_worker" and not settings.external_staging:
            raise ValueError("token_id_capture.external_staging_backend requires external_staging: true")
        if not settings.enabled:
            # Inactive settings stay valid, so a templated config can toggle only ``enabled``.
            return self
        if settings.sink is not None:
            if settings.dir is not None:
                logger.warning(
                    "token_id_capture.dir %s is ignored: token_id_capture.sink %r replaces the file store",
                    settings.dir,
                    settings.sink,
                )
            _require_lineage_store(settings)
            return self
        if installed_token_sink() is not None and self.resolved_dir() is None:
            _require_lineage_store(settings)
            return self
        if not settings.rebuild_response and self.resolved_dir() is None:
            return self
        directory = self.resolved_dir()
        if directory is None:
            raise ValueError(
                "token_id_capture is enabled without a sink, but no directory resolves; set "
                f"token_id_capture.dir or {_FALLBACK_DIR_KEY} to an absolute path, or configure a sink"
            )
        if not directory.is_absolute():
            raise ValueError(
                f"token capture directory {str(directory)!r} is relative; writers and readers in other "
                "processes would resolve it differently, so set an absolute path"
            )
        return self

    def build_sink(self) -> TokenSink | None:
        """Construct the configured sink.

        Return ``None`` when the file store is in use.
        Call this once in each server process; a sink installed by a launcher does not reach spawned workers.
        Raise ``SinkConfigError`` at startup when the sink cannot be built, rather than losing turns later.
        """
        settings = self.token_id_capture
        if not settings.enabled or settings.sink is None:
            return None
        sink: TokenSink = self._build_endpoint(settings.sink, settings.sink_kwargs, TokenSink, "sink")
        return sink

    def build_lineage_store(self) -> LineageResolver | None:
        """Construct the configured lineage store; ``None`` when capture is off or none is configured."""
        settings = self.token_id_capture
        if not settings.enabled or settings.lineage_store is None:
            return None
        store: LineageResolver = self._build_endpoint(
            settings.lineage_store, settings.lineage_store_kwargs, LineageResolver, "lineage_store"
        )
        return store

    @staticmethod
    def _build_endpoint(target: str, kwargs: dict[str, Any], protocol: type, kind: str) -> Any:
        """Import ``module.path:ClassName``, construct it with ``kwargs``, check it satisfies ``protocol``."""
        where = f"token_id_capture.{kind} {target!r}"
        module_name, attribute_path = _split_target(target, where)
        factory = _import_attribute(module_name, attribute_path, where)
        if not callable(factory):
            raise SinkConfigError(f"{where}: {attribute_path} is a {type(factory).__name__}, not a class")
        try:
            endpoint = factory(**kwargs)
        except TypeError as exc:
            raise SinkConfigError(
                f"{where}: the constructor rejected {kind}_kwargs {sorted(kwargs)}: {exc}; "
                f"fix token_id_capture.{kind}_kwargs to match its parameters"
            ) from exc
        except Exception as exc:
            raise SinkConfigError(f"{where}: the constructor raised {type(exc).__name__}: {exc}") from exc
        _check_satisfies(endpoint, protocol, where)
        return endpoint


def _require_lineage_store(settings: TokenIdCaptureSettings) -> None:
    """A custom sink needs a resolver on its backend, else every continuation is unresolved and masked."""
    if settings.lineage_store is not None or installed_lineage_store() is not None:
        return
    if settings.allow_unresolved_continuations:
        logger.warning(
            "token_id_capture has a custom sink and no lineage_store: every continuation resolves "
            "UNRESOLVED and multi-call rollouts will be masked (allow_unresolved_continuations is set)"
        )
        return
    raise ValueError(
        "token_id_capture has a custom sink but no lineage_store, so no continuation can resolve its "
        "parent and every multi-call rollout would be masked; set token_id_capture.lineage_store on the "
        "same backend as the sink, or token_id_capture.allow_unresolved_continuations: true to accept that"
    )


def _split_target(target: str, where: str) -> tuple[str, str]:
    """Split ``module.path:ClassName`` into its halves, refusing anything else."""
    expected = "expected 'module.path:ClassName'"
    if target.count(":") != 1:
        raise SinkConfigError(f"{where} is malformed: {expected} with exactly one colon")
    module_name, attribute_path = (part.strip() for part in target.split(":"))
    if not module_name or not attribute_path:
        raise SinkConfigError(f"{where} is malformed: {expected}, with both sides non-empty")
    for dotted, what in ((module_name, "module path"), (attribute_path, "class name")):
        if not all(part.isidentifier() for part in dotted.split(".")):
            raise SinkConfigError(f"{where} is malformed: {what} {dotted!r} is not a dotted identifier")
    return module_name, attribute_path


def _import_attribute(module_name: str, attribute_path: str, where: str) -> Any:
    """Import the module and walk the attribute path, naming the exact part that failed."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise SinkConfigError(
            f"{where}: module {module_name!r} could not be imported ({exc}); "
            "make it importable in the server process"
        ) from exc
    except Exception as exc:
        raise SinkConfigError(
            f"{where}: importing module {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    value: Any = module
    walked = module_name
    for part in attribute_path.split("."):
        try:
            value = getattr(value, part)
        except AttributeError as exc:
            raise SinkConfigError(f"{where}: {walked!r} has no attribute {part!r}") from exc
        walked = f"{walked}.{part}"
    return value


def _protocol_methods(protocol: type) -> list[str]:
    """The public methods a protocol declares, in declaration order."""
    return [name for name, member in vars(protocol).items() if not name.startswith("_") and callable(member)]


def _check_satisfies(endpoint: Any, protocol: type, where: str) -> None:
    """Refuse an object that lacks any protocol method or implements one synchronously."""
    for name in _protocol_methods(protocol):
        consequence = _WHY_METHOD_MATTERS.get(name, "it is part of the protocol")
        method = getattr(endpoint, name, None)
        if method is None:
            raise SinkConfigError(
                f"{where}: {type(endpoint).__name__} does not satisfy {protocol.__name__}: "
                f"it has no {name}() method; {consequence}"
            )
        if inspect.iscoroutinefunction(getattr(protocol, name)) and not inspect.iscoroutinefunction(method):
            raise SinkConfigError(
                f"{where}: {type(endpoint).__name__} does not satisfy {protocol.__name__}: "
                f"{name}() must be an async method; {consequence}"
            )
    if not isinstance(endpoint, protocol):
        raise SinkConfigError(f"{where}: {type(endpoint).__name__} does not satisfy {protocol.__name__}")


def _plain(value: Any) -> Any:
    """Copy mappings (including config-library mappings) and lists into plain dicts and lists for pydantic."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _describe_validation_error(exc: ValidationError) -> str:
    """One readable clause per problem, each naming the config key at fault."""
    clauses = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        clauses.append(f"{location}: {message}" if location else message)
    return "; ".join(clauses)


def token_id_capture_config(global_config_dict: Any) -> TokenIdCaptureConfig:
    """Read the capture settings out of a global config dict.

    ``None`` yields the defaults (capture disabled).
    Raise ``ConfigError`` for anything that is not a mapping or does not validate.
    """
    if global_config_dict is None:
        global_config_dict = {}
    if not isinstance(global_config_dict, Mapping):
        raise ConfigError(f"the global config must be a mapping, got {type(global_config_dict).__name__}")
    relevant: dict[str, Any] = {}
    block = global_config_dict.get(TOKEN_ID_CAPTURE_BLOCK)
    if block is not None:
        relevant[TOKEN_ID_CAPTURE_BLOCK] = _plain(block)
    if _FALLBACK_DIR_KEY in global_config_dict:
        relevant[_FALLBACK_DIR_KEY] = global_config_dict[_FALLBACK_DIR_KEY]
    try:
        return TokenIdCaptureConfig.model_validate(relevant)
    except ValidationError as exc:
        raise ConfigError(f"invalid token capture configuration: {_describe_validation_error(exc)}") from exc


def token_id_capture_enabled_for_agent(global_config_dict: Any, agent_name: str | None) -> bool:
    """Return whether one configured agent participates in capture.

    Capture must be enabled for the run.
    Then either ``all_agents`` is set, or the agent's static ``token_id_capture`` flag is,
    under ``<agent_name>.responses_api_agents.<any>.token_id_capture``.
    """
    config = token_id_capture_config(global_config_dict)
    if not config.enabled or agent_name is None:
        return False
    if config.token_id_capture.all_agents:
        return True
    agent_config = global_config_dict.get(agent_name)
    if not isinstance(agent_config, Mapping):
        return False
    agents = agent_config.get(_AGENTS_KEY)
    if not isinstance(agents, Mapping):
        return False
    return any(
        isinstance(agent, Mapping) and bool(agent.get(TOKEN_ID_CAPTURE_BLOCK)) for agent in agents.values()
    )

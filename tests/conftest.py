"""Root conftest: loads the Kafka broker fixtures (kafka_bootstrap, kafka_topic, ...) for every test."""

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests/ is not a package; put it on sys.path so the plugin imports the same way under any layout.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

pytest_plugins = [
    "kafka_broker_fixture",
    "gym_wheel",
    "secure_kafka_fixture",
    "session_children",
    "crash_states",
]


@pytest.fixture(autouse=True)
def _private_marker_spill(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's Kafka sinks (and the processes it starts) spill markers into a directory of their own.

    Without it, a marker one test left spilled on a topic name would be forwarded by a later test's sink.
    """
    monkeypatch.setenv("TOKCAP_SPILL_DIR", str(tmp_path_factory.mktemp("marker-spill")))


@pytest.fixture(autouse=True)
def _private_directory_root(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers built without a store_dir (and the processes a test starts) make their directories under a root
    of the test's own, not under the user's cache."""
    monkeypatch.setenv("TOKCAP_PRIVATE_DIR", str(tmp_path_factory.mktemp("private")))


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """A command run in-process configures logging (``tokcap`` at CRITICAL); later tests must see their logs."""
    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    levels = {
        name: logger.level
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    yield
    root.handlers[:] = handlers
    root.setLevel(root_level)
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger):
            logger.setLevel(levels.get(name, logging.NOTSET))

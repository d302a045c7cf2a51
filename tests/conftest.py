"""Root conftest: loads the Kafka broker fixtures (kafka_bootstrap, kafka_topic, ...) for every test."""

import sys
from pathlib import Path

# tests/ is not a package; put it on sys.path so the plugin imports the same way under any layout.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

pytest_plugins = ["kafka_broker_fixture", "gym_wheel", "secure_kafka_fixture"]

"""The parts of the local Kafka broker tool, ``scripts/kafka_broker.py``, one concept a module.

Standard library only, so the tool runs before the project's virtualenv exists. The tool's script names
every public function and constant again, for its CLI and for the pytest fixture that imports it by path.
"""

"""Every confluent-kafka object: clients, the error map, the client log, admin, topics, readers, the producer.

Only this package builds a Kafka client; the rest of the transport asks it.
"""

__all__: list[str] = []

"""Drive the main load through Kafka on a fresh topic once and save the topic's messages (as LogMessage fields)."""
import asyncio, pickle, sys, uuid
from pathlib import Path
from bench.options import WorkloadShape
from bench.load import prepare, drive
from bench.kafka_trial import KafkaTarget, delete_topic
from bench.apply_rate import _read_topic
from transports.kafka.sink import KafkaTokenSink
from transports.kafka.source import KafkaTokenSource
from transports.kafka.topics import ensure_topic
from confluent_kafka import Consumer

BOOT = "127.0.0.1:15418"
async def main(out: str, directory: str) -> None:
    workload = prepare(WorkloadShape(rollouts=64, rounds=2, turns=8, prompt_tokens=1000), "h6prof")
    topic = f"tokcap.h6-prof-{uuid.uuid4().hex[:10]}"
    ensure_topic(BOOT, topic)
    sink = KafkaTokenSink(bootstrap_servers=BOOT, topic=topic)
    source = KafkaTokenSource(bootstrap_servers=BOOT, store_dir=Path(directory), topic=topic)
    try:
        await drive(workload, KafkaTarget(sink, source))
    finally:
        await sink.close(); await source.close()
    ends = source.materializer.high_watermarks() if False else None
    c = Consumer({"bootstrap.servers": BOOT, "group.id": "h6x"})
    md = c.list_topics(topic, timeout=10)
    ends = {}
    for p in md.topics[topic].partitions:
        lo, hi = c.get_watermark_offsets(__import__("confluent_kafka").TopicPartition(topic, p), timeout=10)
        ends[p] = hi
    c.close()
    msgs = _read_topic(BOOT, topic, ends)
    # headers as pairs, as LogMessage holds them
    with open(out, "wb") as f:
        pickle.dump({"topic": topic, "ends": ends, "messages": msgs, "puts": workload.puts}, f)
    print(topic, ends, len(msgs))
    await asyncio.to_thread(delete_topic, BOOT, topic)

asyncio.run(main(sys.argv[1], sys.argv[2]))

"""Produce the saved main-load topic's messages to a fresh topic once, then replay it N times with Materializer."""
import pickle, sys, time, uuid, os, shutil, threading
from pathlib import Path
from confluent_kafka import Producer
from transports.kafka.materializer import Materializer
from transports.kafka.topics import ensure_topic
from bench.kafka_trial import delete_topic
BOOT = "127.0.0.1:15418"
data = pickle.load(open(sys.argv[1], "rb")); repeats = int(sys.argv[2])
topic = f"tokcap.h6-replay-{uuid.uuid4().hex[:10]}"
ensure_topic(BOOT, topic)
p = Producer({"bootstrap.servers": BOOT, "acks": "all", "enable.idempotence": True})
for part, off, value, headers, key in data["messages"]:
    p.produce(topic, value=value, key=key, headers=headers, partition=part)
    p.poll(0)
p.flush(30)
try:
    for r in range(repeats):
        d = Path(f"/tmp/h6-replay/{r}"); shutil.rmtree(d, ignore_errors=True)
        m = Materializer(BOOT, topic, d)
        high = m.high_watermarks()
        c0 = time.process_time(); t0 = time.perf_counter()
        m.start()
        for part, end in high.items():
            m.wait_for(part, end - 1, 120)
        wall = time.perf_counter() - t0
        ths = {t.name: t for t in threading.enumerate()}
        mt = [t for n, t in ths.items() if n.startswith("tokcap-materializer")]
        mcpu = time.clock_gettime(time.pthread_getcpuclockid(mt[0].ident)) if mt else float("nan")
        cpu = time.process_time() - c0
        m.stop()
        n = sum(high.values())
        print(f"replay {r}: {wall*1e6/n:.0f} us wall/message, {n/wall:.0f} events/s, {data['puts']/wall:.0f} entries/s; process CPU {cpu*1e6/n:.0f} us/message, materializer thread CPU {mcpu*1e6/n:.0f} us/message", flush=True)
finally:
    delete_topic(BOOT, topic)

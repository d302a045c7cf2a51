"""Main load over Kafka in process; sample public metrics while it runs: lag gauge, thread CPU, freeze histograms."""
import asyncio, os, threading, time, uuid, statistics
from pathlib import Path
from bench.options import WorkloadShape
from bench.load import prepare, drive
from bench.kafka_trial import KafkaTarget, delete_topic
from bench.stats import percentile
from tokcap.metrics import REGISTRY
from transports.kafka.sink import KafkaTokenSink
from transports.kafka.source import KafkaTokenSource
from transports.kafka.topics import ensure_topic

BOOT = "127.0.0.1:15418"
def sample_value(name):
    v = 0.0
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name == name: v = max(v, s.value)
    return v
def hist(name, **labels):
    cnt = tot = 0.0; buckets = []
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if all(s.labels.get(k) == v for k, v in labels.items()):
                if s.name == name + "_count": cnt = s.value
                if s.name == name + "_sum": tot = s.value
                if s.name == name + "_bucket": buckets.append((float(s.labels["le"]), s.value))
    return cnt, tot, buckets

async def main():
    workload = prepare(WorkloadShape(rollouts=64, rounds=2, turns=8, prompt_tokens=1000), f"h6fp{os.getpid()}")
    topic = f"tokcap.h6-fp-{uuid.uuid4().hex[:10]}"
    ensure_topic(BOOT, topic)
    sink = KafkaTokenSink(bootstrap_servers=BOOT, topic=topic)
    source = KafkaTokenSource(bootstrap_servers=BOOT, store_dir=Path(f"/tmp/h6-fp-{os.getpid()}"), topic=topic)
    lags = []; stop = False
    def sampler():
        while not stop:
            lags.append((time.perf_counter(), sample_value("tokcap_materializer_lag_messages"), sample_value("tokcap_materializer_lag_seconds")))
            time.sleep(0.02)
    th = threading.Thread(target=sampler, daemon=True)
    s0, a0 = hist("tokcap_source_operation_seconds", transport="kafka", operation="freeze"), hist("tokcap_materializer_freeze_seconds")
    cpu0, wall0 = os.times(), time.perf_counter()
    th.start()
    try:
        load = await drive(workload, KafkaTarget(sink, source))
        wall = time.perf_counter() - wall0; cpu1 = os.times()
        threads = {t.name: time.pthread_getcpuclockid(t.ident) for t in threading.enumerate() if t.ident}
        tcpu = {n: time.clock_gettime(c) for n, c in threads.items()}
    finally:
        stop = True
        await sink.close(); await source.close()
        await asyncio.to_thread(delete_topic, BOOT, topic)
    s1, a1 = hist("tokcap_source_operation_seconds", transport="kafka", operation="freeze"), hist("tokcap_materializer_freeze_seconds")
    calls, call_s = s1[0] - s0[0], s1[1] - s0[1]; ans, ans_s = a1[0] - a0[0], a1[1] - a0[1]
    print(f"load wall {wall:.2f}s, puts/s {load.puts_per_s:.0f}; process CPU user {cpu1.user-cpu0.user:.2f}s sys {cpu1.system-cpu0.system:.2f}s -> {((cpu1.user-cpu0.user)+(cpu1.system-cpu0.system))/wall:.2f} cores")
    print("thread CPU s (whole thread life):", {k: round(v, 2) for k, v in sorted(tcpu.items(), key=lambda kv: -kv[1])[:8]})
    f = load.freeze_under_load_ms
    print(f"freezes under load n={len(f)} p50 {percentile(f,0.5):.1f} p99 {percentile(f,0.99):.1f} max {max(f):.1f} ms; after load n={len(load.freeze_after_load_ms)}")
    print(f"source freeze mean {call_s/calls*1000:.1f} ms (n={calls:.0f}); materializer read->answer mean {ans_s/ans*1000:.1f} ms (n={ans:.0f})")
    prev = {b: c for b, c in a0[2]}
    print("read->answer buckets (le ms: count):", [(b*1000, round(c - prev.get(b, 0))) for b, c in a1[2]])
    prevs = {b: c for b, c in s0[2]}
    print("source call buckets (le ms: count):", [(b*1000, round(c - prevs.get(b, 0))) for b, c in s1[2]])
    lm = [l for _, l, _ in lags]; ls = [s for _, _, s in lags]
    print(f"lag messages while loading: median {statistics.median(lm):.0f}, p90 {percentile(lm,0.9):.0f}, max {max(lm):.0f}; lag seconds median {statistics.median(ls):.3f} p90 {percentile(ls,0.9):.3f} max {max(ls):.3f}")
asyncio.run(main())

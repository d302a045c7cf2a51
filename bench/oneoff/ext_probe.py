import asyncio, os, signal, subprocess, sys, time, uuid, json
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
def hist(name, **labels):
    cnt = tot = 0.0
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if all(s.labels.get(k) == v for k, v in labels.items()):
                if s.name == name + "_count": cnt = s.value
                if s.name == name + "_sum": tot = s.value
    return cnt, tot
async def main():
    workload = prepare(WorkloadShape(rollouts=64, rounds=2, turns=8, prompt_tokens=1000), f"h6ext{os.getpid()}")
    topic = f"tokcap.h6-ext-{uuid.uuid4().hex[:10]}"; ensure_topic(BOOT, topic)
    live = Path(f"/tmp/h6-ext-{os.getpid()}"); live.mkdir(parents=True)
    log = live.parent / f"h6-ext-{os.getpid()}.log"
    proc = subprocess.Popen([sys.executable, "bench/oneoff/mat_child.py", BOOT, topic, str(live)], stderr=open(log, "wb"))
    while b"materializer ready" not in log.read_bytes(): time.sleep(0.05)
    spy = None
    if os.environ.get("SPY"):
        spy = subprocess.Popen(["/tmp/pyspy-h6/bin/py-spy", "record", "--pid", str(proc.pid), "--idle", "--nonblocking", "-r", "500", "--format", "raw", "-o", os.environ["SPY"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    sink = KafkaTokenSink(bootstrap_servers=BOOT, topic=topic)
    source = KafkaTokenSource(bootstrap_servers=BOOT, store_dir=live, topic=topic, external_materializer=True)
    c0 = os.times(); w0 = time.perf_counter()
    try:
        load = await drive(workload, KafkaTarget(sink, source))
    finally:
        wall = time.perf_counter() - w0; c1 = os.times()
        await sink.close(); await source.close()
        if spy: spy.send_signal(signal.SIGINT); spy.wait(30)
        proc.send_signal(signal.SIGTERM); proc.wait(60)
        delete_topic(BOOT, topic)
    calls, call_s = hist("tokcap_source_operation_seconds", transport="kafka", operation="freeze")
    child = json.loads(log.read_bytes().decode().strip().splitlines()[-1])
    f = load.freeze_under_load_ms
    b = {le: v for n, le, v in child["buckets"] if n.endswith("_bucket")}
    cnt = next(v for n, le, v in child["buckets"] if n.endswith("_count")); sm = next(v for n, le, v in child["buckets"] if n.endswith("_sum"))
    print(f"load wall {wall:.2f}s puts/s {load.puts_per_s:.0f}; load process CPU {(c1.user-c0.user)+(c1.system-c0.system):.2f}s; materializer process CPU {child['cpu_s']:.2f}s")
    print(f"freeze under load n={len(f)} p50 {percentile(f,0.5):.0f} p99 {percentile(f,0.99):.0f} ms; source call mean {call_s/calls*1000:.0f} ms")
    print(f"materializer read->answered mean {sm/cnt*1000:.0f} ms (n={cnt:.0f}); buckets <=10/50/100/250/500/1000 ms: {[round(b.get(k,0)) for k in ['0.01','0.05','0.1','0.25','0.5','1.0']]}")
    print("log:", log)
    print(f"lag while busy median/max {child['lag']}, checkpoint age median/max s {child['ckpt_age']}")
asyncio.run(main())

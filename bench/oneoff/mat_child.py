"""A materializer process as `python -m transports.kafka.materializer` runs it, reporting its public metrics at exit."""
import json, logging, os, signal, sys, threading, time, statistics
from pathlib import Path
from tokcap.metrics import REGISTRY
from transports.kafka.materializer import Materializer
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s %(message)s")
logging.getLogger("transports.kafka.schedule").setLevel(logging.DEBUG)
boot, topic, directory = sys.argv[1:4]
m = Materializer(boot, topic, Path(directory))
signal.signal(signal.SIGTERM, lambda s, f: m.request_stop())
samples = []; stop = False
def val(name):
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name == name: return s.value
    return float("nan")
def sampler():
    while not stop:
        samples.append((val("tokcap_materializer_lag_messages"), val("tokcap_materializer_checkpoint_age_seconds")))
        time.sleep(0.02)
threading.Thread(target=sampler, daemon=True).start()
c0 = os.times()
m.run_until_stopped()
stop = True
c1 = os.times()
out = {"cpu_s": (c1.user - c0.user) + (c1.system - c0.system), "buckets": [], "lag": [], "ckpt_age": []}
for fam in REGISTRY.collect():
    for s in fam.samples:
        if s.name.startswith("tokcap_materializer_freeze_seconds"):
            out["buckets"].append((s.name, s.labels.get("le"), s.value))
busy = [(l, a) for l, a in samples if l == l and l > 0]
out["lag"] = [statistics.median([l for l, _ in busy]), max(l for l, _ in busy)] if busy else []
out["ckpt_age"] = [statistics.median([a for _, a in busy]), max(a for _, a in busy)] if busy else []
print(json.dumps(out), file=sys.stderr, flush=True)

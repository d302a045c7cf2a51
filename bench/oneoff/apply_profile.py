"""The materializer's per-event path without the consumer or scheduler, over a saved main-load topic.

Per message, in read order: LogMessage, route_deferring, settle, carry_out on the Projection, count_applied,
(freeze) snapshot answer; every BLOCK messages: projection.begin/flush, checkpoint encode + write_checkpoints.
Usage: apply_profile.py PICKLE DIR BLOCK REPEATS [--answer] [--gc-times]
Prints thread CPU us per message of each pass (plain), and GC time measured by gc.callbacks if asked.
"""
import gc, pickle, shutil, sys, time
from pathlib import Path
from tokcap.log_projection import Projection
from tokcap.store import TokenCaptureStore
from tokcap.events import FreezeEvent
from transports.kafka.codec import LogMessage, header_pairs
from transports.kafka.router import InboundRouter, Deferred, ApplyEvent
from transports.kafka.materializer import carry_out
from transports.kafka.loop_metrics import count_applied
from transports.kafka.checkpoint import PartitionCheckpoint, write_checkpoints

data = pickle.load(open(sys.argv[1], "rb"))
root, block, repeats = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
answer = "--answer" in sys.argv
topic = data["topic"]
raw = data["messages"]

gc_ns = [0]; gc_start = [0]
def on_gc(phase, info):
    if phase == "start": gc_start[0] = time.thread_time_ns()
    else: gc_ns[0] += time.thread_time_ns() - gc_start[0]
if "--gc-times" in sys.argv:
    gc.callbacks.append(on_gc)

def one_pass(directory: Path) -> float:
    shutil.rmtree(directory, ignore_errors=True)
    store = TokenCaptureStore(directory)
    projection = Projection(store)
    router = InboundRouter()
    checkpoints = {p: PartitionCheckpoint(topic, p) for p in data["ends"]}
    # the consumer hands Message objects; LogMessage.of is replaced by building the same fields
    msgs = [(p, o, v, h, k) for (p, o, v, h, k) in raw]
    clock = time.thread_time
    t = {"route+decode": 0.0, "apply (carry_out, count, answer)": 0.0, "flush": 0.0, "checkpoint": 0.0, "settle_oldest": 0.0}
    coarse = "--coarse" in sys.argv
    started = time.thread_time()
    for i, (p, o, value, headers, key) in enumerate(msgs):
        if coarse: a = clock()
        lm = LogMessage(p, o, None, key, header_pairs(headers), value)
        ds = [router.settle(d) if isinstance(d, Deferred) else d for d in router.route_deferring(lm)]
        if coarse: b = clock(); t["route+decode"] += b - a
        for d in ds:
            result = carry_out(projection, topic, d)
            count_applied(store, d, result)
            if answer and isinstance(d, ApplyEvent) and isinstance(d.event, FreezeEvent):
                projection.snapshot(d.event.rollout_id, d.position(topic))
        if coarse: t["apply (carry_out, count, answer)"] += clock() - b
        checkpoints[p].next_offset = o + 1
        if (i + 1) % block == 0 or i + 1 == len(msgs):
            if coarse: a = clock()
            projection.begin(); projection.flush()
            if coarse: b = clock(); t["flush"] += b - a
            write_checkpoints(directory, {q: c.encode() for q, c in checkpoints.items()})
            if coarse: c2 = clock(); t["checkpoint"] += c2 - b
            router.settle_oldest(0.0)
            if coarse: t["settle_oldest"] += clock() - c2
    total = (time.thread_time() - started) / len(msgs) * 1e6
    if coarse:
        print("   " + ", ".join(f"{k} {v / len(msgs) * 1e6:.1f}" for k, v in t.items()))
    return total

for r in range(repeats):
    gc_ns[0] = 0
    us = one_pass(root / f"p{r % 2}")
    print(f"pass {r}: {us:.1f} us/message, gc {gc_ns[0] / len(raw) / 1e3:.1f} us/message", flush=True)

"""Classify py-spy raw stacks of apply_profile.py into the per-event steps; leaf-to-root, first matching frame wins."""
import sys, re, collections
RULES = [  # (step, regex on "function (file)")
    ("GC passes", r"gc_collect_main|gc_collect_with_callback|collect_generations"),
    ("count_applied: metrics + freeze's state read (lock file)", r"\((transports/kafka/loop_metrics\.py|prometheus_client/.*)\)"),
    ("checkpoint encode + write + dir fsync", r"\(transports/kafka/checkpoint\.py\)"),
    ("sync at block end (syncfs, group commit)", r"GroupCommitter|sync_filesystem|_barrier|deferred_durability|_Deferral\.__exit__|_Deferral\.close|_Deferral\.finish|_Deferral\.end"),
    ("flush: state file (encode, temp create, write, rename)", r"RolloutState\.encode|_replace_state_file|replace_atomically"),
    ("flush: entries append (open, write, close)", r"write_block_appends|TokenCaptureStore\._append|_Deferral\.append|open_for_append|append_to"),
    ("rollout lock: open/create lock file, flock (at flush)", r"_lock_file|RolloutLocks|_Hold|_locked"),
    ("first event of a rollout: state from disk", r"recovered_for_block"),
    ("line encode (canonical JSON, orjson)", r"canonical_json|PutEvent\.entry_line"),
    ("digests (sha256 of line / entry)", r"\(tokcap/hashing\.py\)|payload_digest|entry_digest"),
    ("state evolve (frozen dataclass, immutables)", r"\(tokcap/state\.py\)"),
    ("decide (rules.decide and its rule functions)", r"\(tokcap/rules\.py\)"),
    ("projection bookkeeping (queue lines, keep entry, LRU)", r"\(tokcap/log_projection\.py\)"),
    ("wire-delta restore (parent lookup, prefix join)", r"ParentRestorer|WireDelta\.restore|delta_parents"),
    ("input validation + event model (input_rules, pydantic)", r"\(tokcap/input_rules\.py\)|TypeAdapter|event_from_mapping|_accepted|\(tokcap/events\.py\)|\(tokcap/records\.py\)|pydantic"),
    ("decode: frame, arrays, JSON head (codec)", r"\(transports/kafka/codec\.py\)"),
    ("route: headers, deferral, settle (router)", r"\(transports/kafka/router\.py\)"),
    ("consumer (librdkafka consume, LogMessage.of)", r"Materializer\._read|LogMessage\.of|consume"),
    ("scheduler (transports/kafka/schedule.py)", r"schedule\.py"),
    ("carry_out / loop glue", r"carry_out|one_pass|Materializer"),
]
GROUPS = [("settle_oldest", "InboundRouter.settle_oldest"), ("flush", "Projection.flush"), ("checkpoint", "write_checkpoints"),
          ("route+decode", "InboundRouter.route_deferring|InboundRouter.settle |header_pairs|LogMessage"), ("apply", "carry_out|count_applied|Projection.snapshot"), ("consumer read", "Materializer._read|consume"), ("scheduler + loop", "schedule.py|Materializer")]
measured = dict(kv.split("=") for kv in sys.argv[3:]) if len(sys.argv) > 3 else {}
group_counts = collections.defaultdict(collections.Counter)
counts = collections.Counter(); total = 0; unmatched = collections.Counter()
for line in open(sys.argv[1]):
    line = line.rstrip("\n")
    if not line: continue
    stack, n = line.rsplit(" ", 1); n = int(n)
    frames = stack.split(";")
    if not any(("one_pass" in f) or ("Materializer._run" in f) or ("Materializer._loop" in f) for f in frames) or any("rmtree" in f for f in frames):
        continue
    total += n
    for frame in reversed(frames):
        f = re.sub(r":\d+\)$", ")", frame)
        step = next((s for s, rx in RULES if re.search(rx, f)), None)
        if step:
            counts[step] += n
            g = next((g for g, rx in GROUPS if any(re.search(rx, fr) for fr in frames)), "other")
            group_counts[g][step] += n
            break
    else:
        unmatched[frames[-1]] += n
scale = float(sys.argv[2]) if len(sys.argv) > 2 else 100.0
print("samples", total)
for s, _ in RULES:
    print(f"{counts[s]/total*100:5.1f}%  {counts[s]/total*scale:6.1f}  {s}")
print("unmatched", sum(unmatched.values()), unmatched.most_common(5))

us = collections.Counter()
for g, c in group_counts.items():
    tot = sum(c.values())
    print(f"== group {g}: {tot} samples ({tot/total*100:.1f}%), measured {measured.get(g, '?')} us")
    for step, n in c.most_common():
        share = n / tot
        print(f"   {share*100:5.1f}%  {step}")
        if g in measured: us[step] += share * float(measured[g])
print("== steps in us (group measured CPU x share in group)")
for step, v in sorted(us.items(), key=lambda kv: -kv[1]): print(f"{v:7.1f}  {step}")
print(f"{sum(us.values()):7.1f}  sum")

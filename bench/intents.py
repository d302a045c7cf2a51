"""Intent and cancel pairs on one rollout: the work per event stays constant as the rollout grows.

    python -m bench.intents [--pairs 1000,2000,4000]

Prints, per size, the seconds to apply the pairs as a projection does (log positions, one deferred block
per 200 events) and through the file store's own durable calls, with the ratio per 1,000 pairs, so a
quadratic cost shows as a ratio that grows with the size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tokcap.events import CancelEvent, IntentEvent, LogPosition
from tokcap.store import TokenCaptureStore

_BLOCK = 200


def _projected(root: Path, pairs: int) -> float:
    store = TokenCaptureStore(root)
    events = []
    for n in range(pairs):
        events.append(IntentEvent(rollout_id="r", model_call_id=f"c{n}"))
        events.append(CancelEvent(rollout_id="r", model_call_id=f"c{n}"))
    start = time.perf_counter()
    for first in range(0, len(events), _BLOCK):
        with store.deferred_durability():
            for offset in range(first, min(first + _BLOCK, len(events))):
                store.apply(events[offset], LogPosition("bench", 0, offset))
    return time.perf_counter() - start


def _direct(root: Path, pairs: int) -> float:
    store = TokenCaptureStore(root)
    start = time.perf_counter()
    for n in range(pairs):
        store.begin_call_now("r", f"c{n}")
        store.cancel_call_now("r", f"c{n}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", default="1000,2000,4000")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    print(f"{'pairs':>6} {'projected s':>12} {'per 1k':>8} {'durable s':>10} {'per 1k':>8}")
    for pairs in (int(p) for p in args.pairs.split(",")):
        projected, direct = [], []
        for _ in range(args.trials):
            with (
                tempfile.TemporaryDirectory(dir=args.dir) as a,
                tempfile.TemporaryDirectory(dir=args.dir) as b,
            ):
                projected.append(_projected(Path(a), pairs))
                direct.append(_direct(Path(b), pairs))
        p, d = statistics.median(projected), statistics.median(direct)
        print(f"{pairs:>6} {p:>12.3f} {p / pairs * 1000:>8.3f} {d:>10.3f} {d / pairs * 1000:>8.3f}")


if __name__ == "__main__":
    main()
